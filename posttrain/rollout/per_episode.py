"""Per-episode multi-turn rollouts through the rollout engine: an episode's next turn is queued as soon as its env
step returns, while the others keep decoding (docs/rollout.md). Shapes: the legend in `posttrain.types`."""
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
    """Runs every sample of `samples` (group-major, after `runner.reset`) to the end of its episode.

    Args:
        generate: the engine's generate(requests, key, on_finish, follow_after=) -> completions.
        make_request: prompt tokens -> its `engine.Request`.
        env_overlap: decode chunks an env step may overlap (0: it runs inside the engine's loop).
    Returns:
        (gen_s, env_s): seconds in the engine's loop (less the env steps at env_overlap 0) and in env steps.
    """
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
        """Steps episode i's env on its last reply; returns its next turn's Request, or None when it ended."""
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
    """Appends completion `c` to sample `s`, its routing laid out as the dense sampler's (-1: the last token)."""

    routing = None
    if c.routing is not None:
        assert len(c.routing) == context_len + len(c.tokens) - 1, (len(c.routing), context_len, len(c.tokens))
        routing = np.concatenate([c.routing, np.full((1,) + c.routing.shape[1:], -1, np.int32)])
    append_reply(s, c.tokens, c.logprobs, bool(c.truncated), tokenizer, c.versions, routing)
