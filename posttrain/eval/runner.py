"""Held-out evaluation: per-domain accuracy (greedy) or pass@k (k samples), and a regression table.

Metrics: `eval/<domain>/accuracy` (fraction of tasks solved; with k > 1 samples, pass@k: at least one of the k
samples solved it), `eval/accuracy` (over all evaluated tasks), `eval/<domain>/mean_reward`.
Scorers: "env" takes the environment's verified reward (reward >= 1 counts as solved); "last_integer" compares
the last integer of the final reply with the task's `answer` (the quickstart's format-agnostic rule).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from posttrain.config import EnvSpec
from posttrain.rollout.episodes import Episode, run_episodes
from posttrain.rollout.rollouter import task_sources
from posttrain.rollout.sampler import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """What held-out evaluation needs of a run (built by `posttrain.recipes.run_plan`). specs: the eval env mix;
    num_tasks: the first this many tasks of each domain; batch_size: episodes per sampler call; scorer: a SCORERS
    name; sampling: the eval rollouts' SamplingParams (greedy by default); max_turns, system_prompt,
    prompt_bucket: as in training rollouts; seed: of the sampling key; every_steps (0: never) / at_start /
    at_end: when the loop evaluates."""

    specs: Mapping[str, EnvSpec]
    sampling: SamplingParams
    num_tasks: int = 200
    batch_size: int = 64
    scorer: str = "env"
    max_turns: int = 1
    system_prompt: str = ""
    prompt_bucket: int = 16
    seed: int = 1
    every_steps: int = 0
    at_start: bool = True
    at_end: bool = True

    def due(self, done: int, total_steps: int) -> bool:
        """Whether the evaluation of `every_steps` runs after `done` completed steps (the last step's is the
        `at_end` one)."""
        return bool(self.every_steps) and done % self.every_steps == 0 and done < total_steps


def eval_episodes(sources: Mapping[str, tuple], num_tasks: int) -> dict[str, list[Episode]]:
    """{domain: [Episode]} over the first `num_tasks` tasks of each (env_id, env_kwargs, task source)."""
    out = {}
    for domain, (env_id, env_kwargs, source) in sources.items():
        n = min(num_tasks, source.num_tasks)
        out[domain] = [Episode(env_id, dict(env_kwargs), source.get_task(i), seed=i, domain=domain) for i in range(n)]
    return out


def solved_by_env(sample) -> bool:
    """The environment's verified reward: >= 1 counts as solved."""
    return sample.reward >= 1.0


def solved_by_last_integer(sample) -> bool:
    """The last integer of the final reply equals the task's answer (`info["gold"]` or `info["answer"]`)."""
    from envs.verify.answers import last_integer

    task_answer = sample.info.get("gold", sample.info.get("answer"))
    got = last_integer(sample.texts[-1] if sample.texts else "")
    try:
        return got is not None and int(str(task_answer).replace(",", "")) == got
    except (TypeError, ValueError):
        return False


SCORERS: dict[str, Callable] = {"env": solved_by_env, "last_integer": solved_by_last_integer}


def solved(sample, scorer: str) -> bool:
    """Whether `sample` solved its task by SCORERS[scorer]. Raises KeyError for an unknown scorer."""
    return SCORERS[scorer](sample)


def evaluate(sample_fn, tokenizer, runner, episodes: Mapping[str, Sequence[Episode]], *, batch_size: int,
             num_samples: int = 1, scorer: str = "env", max_turns: int = 1, pad_id: int = 0, key=None,
             system_prompt: str = "", bucket: int = 16) -> tuple[dict, list]:
    """Runs every episode `num_samples` times; returns (metrics, per-task records)."""
    import jax

    key = jax.random.key(0) if key is None else key
    metrics, records = {}, []
    all_solved = []
    t0 = time.perf_counter()
    for domain, eps in episodes.items():
        solved_d, rewards_d = [], []
        per_batch = max(1, batch_size // num_samples)
        for start in range(0, len(eps), per_batch):
            chunk = eps[start:start + per_batch]
            samples, _ = run_episodes(sample_fn, tokenizer, runner, chunk, group_size=num_samples,
                                      max_turns=max_turns, key=jax.random.fold_in(key, start), pad_id=pad_id,
                                      bucket=bucket, system_prompt=system_prompt)
            for i, ep in enumerate(chunk):
                group = samples[i * num_samples:(i + 1) * num_samples]
                ok = [solved(s, scorer) for s in group]
                solved_d.append(any(ok))
                rewards_d.extend(s.reward for s in group)
                records.append({"domain": domain, "task_id": ep.task.get("id"), "solved": any(ok),
                                "replies": [s.texts[-1] if s.texts else "" for s in group],
                                "rewards": [s.reward for s in group]})
        metrics[f"eval/{domain}/accuracy"] = float(np.mean(solved_d))
        metrics[f"eval/{domain}/mean_reward"] = float(np.mean(rewards_d))
        all_solved.extend(solved_d)
    metrics["eval/accuracy"] = float(np.mean(all_solved)) if all_solved else 0.0
    metrics["perf/eval_s"] = time.perf_counter() - t0
    return metrics, records


def regression_table(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    """A text table of eval/* metrics between two evaluations (e.g. two checkpoints), with deltas."""
    keys = sorted(k for k in set(before) | set(after) if k.startswith("eval/") and k.endswith("accuracy"))
    lines = [f"{'metric':40s} {'before':>8s} {'after':>8s} {'delta':>8s}"]
    for k in keys:
        b, a = before.get(k, float("nan")), after.get(k, float("nan"))
        lines.append(f"{k:40s} {b:8.3f} {a:8.3f} {a - b:+8.3f}")
    return "\n".join(lines)


def settings_episodes(settings: EvalSettings) -> dict[str, list[Episode]]:
    """The held-out episodes of `settings` ({} without eval specs); constructing each env runs its self-check."""
    return eval_episodes(task_sources(settings.specs), settings.num_tasks) if settings.specs else {}


def run(settings: EvalSettings, episodes: Mapping[str, Sequence[Episode]], sample_fn, tokenizer, runner):
    """`evaluate` with the settings' scorer, batch, turns, prompt and sampling key: (eval/* metrics, records)."""
    import jax

    return evaluate(sample_fn, tokenizer, runner, episodes, batch_size=settings.batch_size, scorer=settings.scorer,
                    max_turns=settings.max_turns, pad_id=tokenizer.pad_id, key=jax.random.key(settings.seed),
                    system_prompt=settings.system_prompt, bucket=settings.prompt_bucket)
