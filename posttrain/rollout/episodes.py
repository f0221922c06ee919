"""Host orchestration of rollouts: prompts -> G samples each -> (multi-turn) env episodes, and the env runners.
The trainer scores exactly the tokens the sampler produced (docs/rollout.md).

Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Protocol, Sequence

import numpy as np

from posttrain.rollout.env_results import DEFAULT_MAX_ABS_REWARD
from posttrain.rollout.samples import (Sample, SampleFn, append_reply, apply_result,  # noqa: F401  (public here too)
                                       chat_prompt, turn_bridge)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Episode:
    """One environment episode to run: env id + constructor kwargs, the task dict, and a reset seed."""

    env_id: str
    env_kwargs: dict
    task: dict
    seed: int
    domain: str = ""


class EnvRunner(Protocol):
    """Resets and steps the envs of a batch of episodes (`InlineEnvs`, `EnvPool`, `HostShardedEnvs`)."""

    def reset(self, episodes: Sequence[Episode]) -> list[tuple[str, dict]]: ...

    def step(self, actions: Sequence[str], indices: Sequence[int] | None = None
             ) -> list[tuple[str, float, bool, bool, dict]]: ...


class InlineEnvs:
    """Runs environments in this process; an env's exception ends only its episode, as an infra_error (counted)."""

    def __init__(self):
        import gymnasium

        import envs  # noqa: F401  (registers ids)

        self._make = gymnasium.make
        self._cache: dict[tuple, Any] = {}
        self._active: list[Any] = []
        self._lost: dict[int, dict] = {}  # episode index -> the infra_error info its reset ended with
        self.infra_errors = 0

    def _failed(self, what: str, ep, e: Exception) -> dict:
        self.infra_errors += 1
        reason = f"{what} raised {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        log.warning("env %s: %s (episode ends as infra_error)", getattr(ep, "env_id", ep), reason)
        return {"status": "infra_error", "reason": reason}

    def reset(self, episodes):
        from envs.base import checked_reset

        out, self._active, self._lost = [], [], {}
        for i, ep in enumerate(episodes):
            key = (ep.env_id, tuple(sorted(ep.env_kwargs.items())), i)
            try:
                if key not in self._cache:
                    self._cache[key] = self._make(ep.env_id, **ep.env_kwargs).unwrapped
                env = self._cache[key]
                self._active.append(env)
                out.append(checked_reset(env.reset(seed=ep.seed, options={"task": ep.task}), ep.env_id))
            except Exception as e:  # noqa: BLE001 - an env's own fault ends its episode, not the run
                self._cache.pop(key, None)
                if len(self._active) == i:
                    self._active.append(None)
                self._lost[i] = self._failed("reset", ep, e)
                out.append(("", dict(self._lost[i])))
        return out

    def step(self, actions, indices=None):
        """Steps episodes `indices` (default: all, in reset order) with one action each."""
        indices = range(len(self._active)) if indices is None else indices
        if len(actions) != len(indices):
            raise ValueError(f"step got {len(actions)} actions for {len(indices)} episodes")
        out = []
        for i, a in zip(indices, actions):
            if i in self._lost:
                out.append(("", 0.0, False, True, dict(self._lost.pop(i))))
                continue
            try:
                out.append(self._active[i].step(a))
            except Exception as e:  # noqa: BLE001 - as in reset
                out.append(("", 0.0, False, True, self._failed("step", type(self._active[i]).__name__, e)))
        return out

    def close(self):
        self._cache.clear()


class HostShardedEnvs:
    """An EnvRunner over all processes: each runs its share of the episodes locally, and all get every result.

    `max_abs_reward` is the reward bound of every `run_episodes` call on this runner."""

    def __init__(self, local: EnvRunner, max_abs_reward: float = DEFAULT_MAX_ABS_REWARD):
        self.local = local
        self.max_abs_reward = max_abs_reward
        self.episodes = 0
        self.env_steps = 0
        self._share = range(0)

    def reset(self, episodes):
        from posttrain.infra import distributed
        self._share = distributed.host_share(len(episodes))
        mine = [episodes[i] for i in self._share]
        out = self.local.reset(mine) if mine else []
        self.episodes += len(mine)
        return [r for part in distributed.allgather_objects(out) for r in part]

    def step(self, actions, indices=None):
        from posttrain.infra import distributed
        indices = range(len(actions)) if indices is None else indices  # None: every episode of the reset
        if len(actions) != len(indices):
            raise ValueError(f"step got {len(actions)} actions for {len(indices)} episodes")
        mine = [(i, a) for i, a in zip(indices, actions) if i in self._share]
        out = self.local.step([a for _, a in mine], [i - self._share.start for i, _ in mine]) if mine else []
        self.env_steps += len(mine)
        results = dict(pair for part in distributed.allgather_objects(list(zip([i for i, _ in mine], out)))
                       for pair in part)
        return [results[i] for i in indices]

    def close(self):
        if hasattr(self.local, "close"):
            self.local.close()


def run_episodes(sample_fn: SampleFn, tokenizer, runner: EnvRunner, episodes: Sequence[Episode], *,
                 group_size: int, max_turns: int, key, pad_id: int, bucket: int = 16,
                 system_prompt: str = "", stream: bool = False,
                 max_abs_reward: float | None = None) -> tuple[list[Sample], dict]:
    """Runs P episodes x G samples to completion; returns the samples (group-major) and perf/{gen,reward,rollout}_s.

    Args:
        max_abs_reward: the reward bound of `check_result` (None: the runner's, else the default).
        stream: streaming scoring: `sample_fn` takes `on_rows=`, finished rows are stepped while the rest decodes.
    """
    import jax

    from posttrain.infra import distributed
    from posttrain.rollout import turns
    from posttrain.generate.sampler import pad_prompts

    G = group_size
    t0 = time.perf_counter()
    if max_abs_reward is None:
        max_abs_reward = getattr(runner, "max_abs_reward", DEFAULT_MAX_ABS_REWARD)
    expanded = [ep for ep in episodes for _ in range(G)]
    first = runner.reset(expanded)
    prompts = [chat_prompt(tokenizer, first[p * G][0], system_prompt, first[p * G][1]) for p in range(len(episodes))]
    samples = [Sample(domain=ep.domain, group=i // G, prompt_ids=prompts[i // G]) for i, ep in enumerate(expanded)]
    gen_s = env_s = 0.0
    contexts = None  # per-sample full token context for turns >= 2
    if max_turns > 1 and getattr(sample_fn, "generate", None) is not None:  # the engine: per-episode turns
        from posttrain.rollout import per_episode

        engine = sample_fn.engine_for(max(map(len, prompts)) + sample_fn.request([0]).max_new_tokens)
        gen_s, env_s = per_episode.run(functools.partial(sample_fn.generate, engine), sample_fn.request,
                                       engine.settings.max_seq_len, tokenizer, runner, samples, prompts,
                                       group_size=G, max_turns=max_turns, key=key,
                                       env_overlap=getattr(sample_fn, "env_overlap", 0),
                                       env_ids=[ep.env_id for ep in expanded], max_abs_reward=max_abs_reward)
        max_turns = 0  # the turn loop below has nothing left to run
    for turn in range(max_turns):
        active = [i for i, s in enumerate(samples) if not s.done]
        if not active:
            break
        t = time.perf_counter()
        if turn == 0:
            toks, lens = pad_prompts(prompts, pad_id, bucket)
        else:
            toks, lens = pad_prompts([contexts[i] for i in active], pad_id, bucket)
        scorer = _scorer(runner, active, tokenizer) if stream else None
        extra = {"on_rows": scorer.rows_finished} if scorer else {}
        out = sample_fn(toks, lens, jax.random.fold_in(key, turn), G if turn == 0 else 1, **extra)
        out = distributed.to_host(out)  # every process gets the full batch (one process: np.asarray)
        gen_s += time.perf_counter() - t
        replies = [_take_row(samples[i], out, row, tokenizer, prompts[i // G] if turn == 0 else contexts[i],
                             i // G if turn == 0 else row) for row, i in enumerate(active)]
        t = time.perf_counter()
        if scorer is None:
            results = runner.step(replies, None if turn == 0 else active)
        else:
            _, results = scorer.finish(out.tokens_NxLg, out.lengths_N)  # checks each streamed reply
        env_s += time.perf_counter() - t
        for row, i in enumerate(active):
            apply_result(samples[i], results[row], replies[row], tokenizer, expanded[i].env_id, max_abs_reward)
        before = [prompts[i // G] for i in range(len(samples))] if turn == 0 else contexts
        contexts = [s.prompt_ids + [int(x) for t, _, _ in s.segments for x in t] for s in samples]
        for i in active:  # token append keeps the extension property (rollout.turns): a failure is a bug
            turns.assert_extends(before[i], contexts[i], f"episode {i}'s turn {turn + 2} context")
    for s in samples:
        if not s.done:  # cut by env.max_turns before the env ended the episode: its last status (e.g. the tool
            # run's "ok") says nothing of the episode; the reward is the env's last one
            s.done, s.status = True, "truncated"
            s.info = {**s.info, "reason": f"env.max_turns={max_turns} reached before the env ended the episode"}
    return samples, {"perf/gen_s": gen_s, "perf/reward_s": env_s, "perf/rollout_s": time.perf_counter() - t0}


def _scorer(runner, active: list[int], tokenizer):
    """The streaming scorer of one turn: sampler row r is episode active[r]."""
    from posttrain.generate.streaming import TurnScorer

    return TurnScorer(runner, active, lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=True))


def _take_row(s: Sample, out, row: int, tokenizer, context: list[int], prompt_row: int) -> str:
    """Appends sampler row `row` of `out` to sample `s`; returns its reply (`context`: the tokens it continued)."""
    n = int(out.lengths_N[row])
    versions = getattr(out, "versions_NxLg", None)
    routing = None
    if getattr(out, "experts_NxLgxLxk", None) is not None:  # the prefill covered the whole context
        routing = np.concatenate([out.prompt_experts_PxLpxLxk[prompt_row, :len(context)],
                                  out.experts_NxLgxLxk[row, :n]])
    return append_reply(s, out.tokens_NxLg[row, :n], out.logp_NxLg[row, :n], bool(out.truncated_N[row]), tokenizer,
                        None if versions is None else versions[row, :n], routing)
