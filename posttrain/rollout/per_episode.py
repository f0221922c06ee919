"""Per-episode multi-turn rollouts through the rollout engine (issue 25 item 5).

Dimension legend: P episodes (groups), G group size, N = P*G samples, Lg max new tokens per turn.

`episodes.run_episodes` runs a multi-turn batch turn by turn: every episode's turn t is sampled, then every env
steps, then turn t + 1 starts for all. With the rollout engine (`EngineSampler.sample_fn`'s `generate`) it calls
`run` instead: each of the N samples is one engine request, and when a reply ends the engine's `on_finish` steps
that episode's env at once and queues its next turn (the context so far + the reply + the bridge tokens) while the
other episodes keep decoding; the next turn finds its earlier turns' pages in the prefix cache, so it prefills
only the bridge. With `env_overlap` > 0 the env steps on a thread of its own while the engine decodes the other
episodes, and the next turn is queued `env_overlap` decode chunks after the reply ended (`Engine.generate`'s
`follow_after`; the engine waits for the env then if it is slower), so a run is the same however long each env
step takes. The token bookkeeping is `run_episodes`'s: the context grows by appending what the engine produced
and the bridge (`turns.assert_extends` at every turn), the bridge is masked out of the loss, and each policy
segment keeps its logprobs, versions and (routing replay) expert selections.

A next turn that would not fit the engine (context + Lg > its max_seq_len) ends the episode as "truncated" with
the reason in its info, as `env.max_turns` does; nothing is lost. At env_overlap 0 the env steps inside the engine's loop (the other slots'
decode waits for it).
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from posttrain.rollout import turns
from posttrain.rollout.samples import append_reply, apply_result


def run(generate: Callable, make_request: Callable, max_seq_len: int, tokenizer, runner, samples: Sequence,
        prompts: Sequence[list[int]], *, group_size: int, max_turns: int, key,
        env_overlap: int = 0, env_ids: Sequence[str] | None = None,
        max_abs_reward: float | None = None) -> tuple[float, float]:
    """Runs every sample of `samples` (group-major, after `runner.reset`; sample i answers prompts[i // G]) to the
    end of its episode. generate(requests, key, on_finish, follow_after=) -> completions: the engine's
    `generate`; make_request(prompt tokens) -> its `engine.Request` with the call's sampling settings;
    max_seq_len: the longest request the engine takes; env_overlap: decode chunks an env step may overlap (0: it
    runs inside the engine's loop; > 0: the runner is called from one other thread, one step at a time); env_ids:
    the env id of each sample (None: ""), named when its env's result is refused (`env_results.check_result`, with
    `max_abs_reward`; None: env_results.DEFAULT_MAX_ABS_REWARD).
    Returns (gen_s, env_s): seconds in the engine's loop (less the env steps it ran, at env_overlap 0) and in env
    steps (overlapping gen_s at env_overlap > 0). Raises what the env runner raises."""
    from posttrain.rollout.env_results import DEFAULT_MAX_ABS_REWARD

    G = group_size
    env_ids = [""] * len(samples) if env_ids is None else list(env_ids)
    bound = DEFAULT_MAX_ABS_REWARD if max_abs_reward is None else max_abs_reward
    contexts = [list(prompts[i // G]) for i in range(len(samples))]
    owner, turn_of = list(range(len(samples))), [0] * len(samples)  # request index -> sample, its turn
    env_s = [0.0]

    def on_finish(index: int, c):
        i, s = owner[index], samples[owner[index]]
        _take(s, c, tokenizer, len(contexts[i]))
        turn = turn_of[index] + 1
        if pool is None:
            request = next_turn(i, s, turn)
            if request is not None:
                owner.append(i)
                turn_of.append(turn)
            return request
        owner.append(i)  # the engine gives a Future the next index at once
        turn_of.append(turn)
        return pool.submit(next_turn, i, s, turn)

    def next_turn(i: int, s, turn: int):
        """Steps episode i's env on its last reply; the Request of its turn `turn`, or None when it ended."""
        t = time.perf_counter()
        result = runner.step([s.texts[-1]], [i])[0]
        env_s[0] += time.perf_counter() - t
        apply_result(s, result, s.texts[-1], tokenizer, env_ids[i], bound)
        if s.done or turn >= max_turns:
            return None
        context = s.prompt_ids + [int(x) for seg, _, _ in s.segments for x in seg]
        turns.assert_extends(contexts[i], context, f"episode {i}'s turn {turn + 1} context")
        request = make_request(context)
        if len(context) + request.max_new_tokens > max_seq_len:
            s.done, s.status = True, "truncated"
            s.info = {**s.info, "reason": f"turn {turn + 1}'s context ({len(context)} tokens) + max_new_tokens "
                                          f"{request.max_new_tokens} exceeds the engine's max_seq_len={max_seq_len}"}
            return None
        contexts[i] = context
        return request

    t0 = time.perf_counter()
    with ThreadPoolExecutor(1, thread_name_prefix="episode-env") if env_overlap else contextlib.nullcontext() as pool:
        generate([make_request(contexts[i]) for i in range(len(samples))], key, on_finish,
                 follow_after=env_overlap)
    wall = time.perf_counter() - t0
    return (wall if env_overlap else wall - env_s[0]), env_s[0]


def _take(s, c, tokenizer, context_len: int) -> None:
    """Appends completion `c` (`engine.Completion`) to sample `s` (`episodes.append_reply`), its routing laid out as
    the dense sampler's: the context's and the reply's selections, -1 for its last token (never fed)."""

    routing = None
    if c.routing is not None:
        assert len(c.routing) == context_len + len(c.tokens) - 1, (len(c.routing), context_len, len(c.tokens))
        routing = np.concatenate([c.routing, np.full((1,) + c.routing.shape[1:], -1, np.int32)])
    append_reply(s, c.tokens, c.logprobs, bool(c.truncated), tokenizer, c.versions, routing)
