"""Per-episode multi-turn rollouts through the rollout engine (issue 25 item 5).

Dimension legend: P episodes (groups), G group size, N = P*G samples, Lg max new tokens per turn.

`episodes.run_episodes` runs a multi-turn batch turn by turn: every episode's turn t is sampled, then every env
steps, then turn t + 1 starts for all. With the rollout engine (`EngineSampler.sample_fn`'s `generate`) it calls
`run` instead: each of the N samples is one engine request, and when a reply ends the engine's `on_finish` steps
that episode's env at once and queues its next turn (the context so far + the reply + the bridge tokens) while the
other episodes keep decoding; the next turn finds its earlier turns' pages in the prefix cache, so it prefills
only the bridge. The token bookkeeping is `run_episodes`'s: the context grows by appending what the engine produced
and the bridge (`turns.assert_extends` at every turn), the bridge is masked out of the loss, and each policy
segment keeps its logprobs, versions and (routing replay) expert selections.

A next turn that would not fit the engine (context + Lg > its max_seq_len) ends the episode as "truncated" with
the reason in its info, as `env.max_turns` does; nothing is lost. The env steps in the engine's loop (the decode
of the other slots waits for it): suited to in-process and pooled envs whose step is short beside a turn.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from posttrain.rollout import turns


def run(generate: Callable, make_request: Callable, max_seq_len: int, tokenizer, runner, samples: Sequence,
        prompts: Sequence[list[int]], *, group_size: int, max_turns: int, key) -> tuple[float, float]:
    """Runs every sample of `samples` (group-major, after `runner.reset`; sample i answers prompts[i // G]) to the
    end of its episode. generate(requests, key, on_finish) -> completions: the engine's `generate`;
    make_request(prompt tokens) -> its `engine.Request` with the call's sampling settings; max_seq_len: the longest
    request the engine takes. Returns (gen_s, env_s): seconds in the engine's loop (env steps excluded) and in env
    steps. Raises what the env runner raises."""
    from posttrain.rollout.episodes import _apply_result

    G = group_size
    contexts = [list(prompts[i // G]) for i in range(len(samples))]
    owner, turn_of = list(range(len(samples))), [0] * len(samples)  # request index -> sample, its turn
    env_s = [0.0]

    def on_finish(index: int, c):
        i, s = owner[index], samples[owner[index]]
        _take(s, c, tokenizer, len(contexts[i]))
        t = time.perf_counter()
        result = runner.step([s.texts[-1]], [i])[0]
        env_s[0] += time.perf_counter() - t
        _apply_result(s, result, s.texts[-1], tokenizer)
        turn = turn_of[index] + 1
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
        owner.append(i)
        turn_of.append(turn)
        return request

    t0 = time.perf_counter()
    generate([make_request(contexts[i]) for i in range(len(samples))], key, on_finish)
    return time.perf_counter() - t0 - env_s[0], env_s[0]


def _take(s, c, tokenizer, context_len: int) -> None:
    """Appends completion `c` (`engine.Completion`) to sample `s` (`episodes.append_reply`), its routing laid out as
    the dense sampler's: the context's and the reply's selections, -1 for its last token (never fed)."""
    from posttrain.rollout.episodes import append_reply

    routing = None
    if c.routing is not None:
        assert len(c.routing) == context_len + len(c.tokens) - 1, (len(c.routing), context_len, len(c.tokens))
        routing = np.concatenate([c.routing, np.full((1,) + c.routing.shape[1:], -1, np.int32)])
    append_reply(s, c.tokens, c.logprobs, bool(c.truncated), tokenizer, c.versions, routing)
