"""Held-out evaluation: each domain's episodes sampled into per-task records, their loop metrics and summaries.

Shapes: the legend in `posttrain.types`. Record fields, scorers and formats: docs/evaluation.md.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import time
import zlib
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from posttrain.errors import AT_LEAST_ONE, NONNEGATIVE, check_fields
from posttrain.eval import collapse as collapse_lib
from posttrain.eval import metrics as metrics_lib
from posttrain.eval.gate import GateConfig
from posttrain.rollout.episodes import Episode, run_episodes
from posttrain.rollout.floor_metrics import env_floor, spec_floors  # noqa: F401  (re-exported: suite.py, tests)
from posttrain.rollout.env_side import task_sources
from posttrain.generate.sampler import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """The `eval` section: held-out evaluation on `env.eval`, and the evaluation gate.

    Attributes:
        every_steps: evaluate every this many steps during training (0: never); the suite's gate runs then too.
        at_start: evaluate before the first step.
        at_end: evaluate after the last step.
        num_tasks: the first this many tasks of each domain.
        max_new_tokens: completion tokens per eval turn.
        temperature: eval sampling temperature (0: greedy).
        batch_size: episodes per sampler call.
        scorer: "env" (the env's reward >= 1 solves) or "last_integer" (the reply's last integer vs the answer).
        seed: the evaluation sampling stream, folded per domain and batch (-1: train.seed + 1).
        suite: a `configs/eval/*.py` suite run every `every_steps` steps against the initial policy ("": no gate).
        gate: what a regression on the suite does (GateConfig).
    """

    every_steps: int = 0
    at_start: bool = True
    at_end: bool = True
    num_tasks: int = 200
    max_new_tokens: int = 24
    temperature: float = 0.0
    batch_size: int = 64
    scorer: str = "env"
    seed: int = -1
    suite: str = ""
    gate: GateConfig = GateConfig()

    def __post_init__(self):
        check_fields(self, choices={"scorer": SCORERS}, ranges={
            "batch_size": AT_LEAST_ONE, "max_new_tokens": AT_LEAST_ONE, "num_tasks": AT_LEAST_ONE,
            "every_steps": NONNEGATIVE, "temperature": (">= 0 (0: greedy)", lambda v: v >= 0),
            "seed": (">= 0, or -1 (train.seed + 1)", lambda v: v >= -1)})


log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """What held-out evaluation needs of a run (`posttrain.config.plan.RunPlan.eval_settings` builds it).

    Attributes:
        eval_config: the `eval` section.
        env_config: the `env` section (the `eval` mix; turns per episode as in training).
        sampling_config: the `sampling` section (system prompt and prompt bucket as in training rollouts).
        seed: of the sampling stream (`eval.seed` resolved).
    """

    eval_config: EvalConfig
    env_config: Any
    sampling_config: Any
    seed: int = 1

    @property
    def sampling(self) -> SamplingParams:
        """The eval rollouts' SamplingParams (greedy by default)."""
        return SamplingParams(max_new_tokens=self.eval_config.max_new_tokens, temperature=self.eval_config.temperature)

    def due(self, done: int, total_steps: int) -> bool:
        """Whether the `every_steps` evaluation runs after `done` steps (the last step's is at_end's)."""
        every = self.eval_config.every_steps
        return bool(every) and done % every == 0 and done < total_steps


def eval_episodes(sources: Mapping[str, tuple], num_tasks: int) -> dict[str, list[Episode]]:
    """{domain: [Episode]} over the first `num_tasks` tasks of each (env_id, env_kwargs, task source)."""
    out = {}
    for domain, (env_id, env_kwargs, source) in sources.items():
        n = min(num_tasks, source.num_tasks)
        out[domain] = [Episode(env_id, dict(env_kwargs), source.get_task(i), seed=i, domain=domain) for i in range(n)]
    return out


def solved_by_env(reply: str, reward: float, info: Mapping) -> bool:
    """The environment's verified reward: >= 1 counts as solved."""
    return reward >= 1.0


def solved_by_last_integer(reply: str, reward: float, info: Mapping) -> bool:
    """The last integer of the final reply equals the task's answer (`info["gold"]` or `info["answer"]`)."""
    from envs.verify.answers import last_integer

    task_answer = info.get("gold", info.get("answer"))
    got = last_integer(reply)
    try:
        return got is not None and int(str(task_answer).replace(",", "")) == got
    except (TypeError, ValueError):
        return False


SCORERS: dict[str, Callable[[str, float, Mapping], bool]] = {"env": solved_by_env,
                                                             "last_integer": solved_by_last_integer}

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n.*?```", re.S)
_HASH_LINE = re.compile(r"^[ \t]*####[ \t]*\S", re.M)
_ANSWER_TAG = re.compile(r"<answer>.*?</answer>", re.S)
_INTEGER = re.compile(r"-?\d")

# answer-format compliance of a final reply (str -> bool): whether it has the form the domain asks for
FORMATS: dict[str, Callable[[str], bool]] = {
    "nonempty": lambda reply: bool(reply.strip()),
    "number": lambda reply: _INTEGER.search(reply) is not None,
    "hash": lambda reply: _HASH_LINE.search(reply) is not None,  # GSM8K's "#### N" line
    "boxed": lambda reply: "\\boxed{" in reply,
    "answer_tag": lambda reply: _ANSWER_TAG.search(reply) is not None,  # reasoning-gym's <answer>...</answer>
    "code_block": lambda reply: _FENCE.search(reply) is not None,  # a fenced ```python block
}


def solved(sample, scorer: str) -> bool:
    """Whether `sample` solved its task by SCORERS[scorer]. Raises KeyError for an unknown scorer."""
    return SCORERS[scorer](sample.texts[-1] if sample.texts else "", sample.reward, sample.info)


def task_record(ep: Episode, index: int, group: Sequence, prompt: str, *, scorer: str, fmt: str, greedy: bool,
                area: str = "") -> dict:
    """The record of one task from its N samples (`rollout.episodes.Sample`)."""
    replies = [s.texts[-1] if s.texts else "" for s in group]
    record = {"domain": ep.domain, "area": area, "task_id": ep.task.get("id", index), "index": index,
              "prompt": prompt, "replies": replies, "statuses": [s.status for s in group],
              "rewards": [float(s.reward) for s in group], "correct": [solved(s, scorer) for s in group],
              "formatted": [FORMATS[fmt](r) for r in replies],
              "lengths": [int(sum(len(t) for t, _, policy in s.segments if policy)) for s in group],
              "truncated": [bool(s.truncated) for s in group], "greedy": greedy}
    floor = episode_floor(ep)
    if floor is not None:
        record["floor"] = floor
    gold = group[0].info.get("gold", group[0].info.get("answer")) if group else None
    if gold is not None:
        record["gold"] = str(gold)
    if group and group[0].info.get("evidence_depth") is not None:  # where the task's evidence starts, in [0, 1]
        record["depth"] = float(group[0].info["evidence_depth"])
    if any(len(s.texts) > 1 for s in group):
        record["turns"] = [list(s.texts) for s in group]
    return record


def sample_groups(sample_fn, tokenizer, runner, episodes: Sequence[Episode], *, batch_size: int,
                  num_samples: int = 1, max_turns: int = 1, key=None, system_prompt: str = "", bucket: int = 16,
                  on_batch: Callable[[Sequence[Episode], float], None] | None = None) -> list[tuple]:
    """(episode, its N samples, prompt text) per episode, each run `num_samples` times, `batch_size` samples a call."""
    import jax

    key = jax.random.key(0) if key is None else key
    out = []
    per_batch = max(1, batch_size // num_samples)
    for start in range(0, len(episodes), per_batch):
        chunk, t0 = episodes[start:start + per_batch], time.perf_counter()
        samples, _ = run_episodes(sample_fn, tokenizer, runner, chunk, group_size=num_samples, max_turns=max_turns,
                                  key=jax.random.fold_in(key, start), pad_id=tokenizer.pad_id, bucket=bucket,
                                  system_prompt=system_prompt)
        for i, ep in enumerate(chunk):
            group = samples[i * num_samples:(i + 1) * num_samples]
            out.append((ep, group, tokenizer.decode(group[0].prompt_ids, skip_special_tokens=False)))
        if on_batch is not None:
            on_batch(chunk, time.perf_counter() - t0)
    return out


def sample_domain(sample_fn, tokenizer, runner, episodes: Sequence[Episode], *, batch_size: int, num_samples: int = 1,
                  scorer: str = "env", fmt: str = "nonempty", greedy: bool = True, max_turns: int = 1, key=None,
                  system_prompt: str = "", bucket: int = 16, area: str = "") -> list[dict]:
    """`sample_groups` of one domain's episodes as one record per episode (`task_record`), in order."""
    groups = sample_groups(sample_fn, tokenizer, runner, episodes, batch_size=batch_size, num_samples=num_samples,
                           max_turns=max_turns, key=key, system_prompt=system_prompt, bucket=bucket)
    return [task_record(ep, i, group, prompt, scorer=scorer, fmt=fmt, greedy=greedy, area=area)
            for i, (ep, group, prompt) in enumerate(groups)]


def domain_key(key, domain: str):
    """The sampling key of `domain`: `key` folded with crc32 of its name (adding a domain changes no other's)."""
    import jax

    return jax.random.fold_in(key, zlib.crc32(domain.encode("utf-8")) & 0x7FFFFFFF)


def evaluate(sample_fn, tokenizer, runner, episodes: Mapping[str, Sequence[Episode]], *, batch_size: int,
             num_samples: int = 1, scorer: str = "env", max_turns: int = 1, key=None, greedy: bool = True,
             system_prompt: str = "", bucket: int = 16) -> tuple[dict, list]:
    """Runs every episode `num_samples` times with one sampler; returns (`loop_metrics` + perf/eval_s, records)."""
    import jax

    key = jax.random.key(0) if key is None else key
    t0 = time.perf_counter()
    records = []
    for domain, eps in episodes.items():
        records += sample_domain(sample_fn, tokenizer, runner, eps, batch_size=batch_size, num_samples=num_samples,
                                 scorer=scorer, greedy=greedy, max_turns=max_turns, key=domain_key(key, domain),
                                 system_prompt=system_prompt, bucket=bucket)
    return {**loop_metrics(records), "perf/eval_s": time.perf_counter() - t0}, records


def loop_metrics(records: Sequence[Mapping], floors: Mapping[str, float | None] | None = None) -> dict[str, float]:
    """The loop's eval/* metrics over the scored samples; nothing scored gives no pass@1, never a 0."""
    out, all_pass, floors = {}, [], _domain_floors(records, floors)
    kept, counts = metrics_lib.scored_only(records)
    scored = metrics_lib.by_domain(kept)
    for domain, c in counts.items():
        if c["infra_errors"]:
            out[f"eval/{domain}/infra_error_rate"] = c["infra_errors"] / c["samples"]
            out[f"eval/{domain}/unscored_tasks"] = float(c["unscored_tasks"])
            log.warning("eval: %s: %d of %d samples ended in infra_error (the env or its sandbox failed); %s",
                        domain, c["infra_errors"], c["samples"],
                        "no task was scored" if domain not in scored else
                        f"{c['unscored_tasks']} task(s) unscored; pass@1 is over the scored samples")
    for domain, rs in scored.items():
        p = metrics_lib.per_task(rs, "pass@1")
        out[f"eval/{domain}/pass@1"] = float(p.mean())
        out[f"eval/{domain}/mean_reward"] = float(metrics_lib.per_task(rs, "mean_reward").mean())
        if floors.get(domain) is not None:
            out[f"eval/{domain}/above_floor"] = out[f"eval/{domain}/mean_reward"] - float(floors[domain])
        all_pass.extend(p)
    if all_pass:  # no scored task anywhere (every sample an infra_error): no headline figure, never a 0
        out["eval/pass@1"] = float(np.mean(all_pass))
    return out


def episode_floor(ep: Episode) -> float | None:
    """`env_floor` of an episode's env."""
    return env_floor(ep.env_id, ep.env_kwargs)


def _domain_floors(records: Sequence[Mapping], floors: Mapping[str, float | None] | None) -> dict:
    """`floors`, else {domain: the "floor" its records carry}."""
    if floors is not None:
        return dict(floors)
    return {r["domain"]: r["floor"] for r in records if r.get("floor") is not None}


def suite_summary(records: Sequence[Mapping], ks: Mapping[str, Sequence[int]] | None = None,
                  floors: Mapping[str, float | None] | None = None) -> dict:
    """{"area_of", "domains", "areas", "all"}: task-weighted `metrics.summarize_domain` summaries of scored samples.

    Each also counts infra errors; a domain's adds the collapse check and above_floor. ValueError for no records.
    """
    ks, floors = ks or {}, _domain_floors(records, floors)
    if not records:
        raise ValueError("suite_summary of no records")
    area_of = {r["domain"]: r.get("area") or "-" for r in records}
    records, counts = metrics_lib.scored_only(records)
    by_area: dict[str, list] = {}
    for r in records:
        by_area.setdefault(r.get("area") or "-", []).append(r)
    all_ks = sorted({k for v in ks.values() for k in v})
    empty, scored = {"tasks": 0, "n_min": 0}, {r["domain"] for r in records}
    domains = {d: dict(empty) for d in counts if d not in scored}  # nothing scored: no metric
    for d, rs in metrics_lib.by_domain(records).items():
        s = metrics_lib.summarize_domain(rs, ks.get(d, ()))
        c = collapse_lib.domain_collapse(rs)
        s.update(modal_share=c.modal_share, collapsed=float(c.collapsed))
        if c.gold_modal_share is not None:
            s["gold_modal_share"] = c.gold_modal_share
        if floors.get(d) is not None:
            s["above_floor"] = s["mean_reward"] - float(floors[d])
        domains[d] = s
    for d, c in counts.items():
        domains[d].update(infra_errors=c["infra_errors"], unscored_tasks=c["unscored_tasks"])
    areas = {a: metrics_lib.summarize_domain(by_area[a], all_ks) if a in by_area else dict(empty)
             for a in dict.fromkeys(area_of.values())}
    for a, s in areas.items():
        in_area = [counts[d] for d, da in area_of.items() if da == a]
        s.update(infra_errors=sum(c["infra_errors"] for c in in_area),
                 unscored_tasks=sum(c["unscored_tasks"] for c in in_area))
    every = metrics_lib.summarize_domain(list(records), all_ks) if records else dict(empty)
    every.update(infra_errors=sum(c["infra_errors"] for c in counts.values()),
                 unscored_tasks=sum(c["unscored_tasks"] for c in counts.values()))
    return {"area_of": area_of, "domains": {d: domains[d] for d in area_of}, "areas": areas, "all": every}


def settings_episodes(settings: EvalSettings) -> dict[str, list[Episode]]:
    """The held-out episodes of `settings` ({} without eval specs); constructing each env runs its self-check."""
    specs = settings.env_config.eval
    return eval_episodes(task_sources(specs), settings.eval_config.num_tasks) if specs else {}


def run(settings: EvalSettings, episodes: Mapping[str, Sequence[Episode]], sample_fn, tokenizer, runner):
    """`evaluate` with the settings' scorer, batch, turns, prompt and sampling key: (eval/* metrics, records)."""
    import jax

    e, s = settings.eval_config, settings.sampling_config
    return evaluate(sample_fn, tokenizer, runner, episodes, batch_size=e.batch_size, scorer=e.scorer,
                    max_turns=settings.env_config.max_turns, key=jax.random.key(settings.seed),
                    greedy=e.temperature == 0.0, system_prompt=s.system_prompt, bucket=s.prompt_bucket)


