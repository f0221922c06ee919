"""Evaluation metrics over per-task records: unbiased pass@k, pass@1, mean reward, format, length, truncation.

Shapes: the legend in `posttrain.types`. Unscored samples go first (`scored_only`); record fields: docs/evaluation.md.
"""
from __future__ import annotations

import functools
import hashlib
import json
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

OPTIONAL_FIELDS = {"format_rate": "formatted", "mean_length": "lengths", "truncation_rate": "truncated"}
INFRA_ERROR = "infra_error"  # envs.verify.answers.INFRA_ERROR (no envs import here)
PER_SAMPLE_FIELDS = ("replies", "statuses", "rewards", "correct", "formatted", "lengths", "truncated", "turns")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples, c correct: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021); ValueError: k > n."""
    n, c, k = _as_int(n, "n"), _as_int(c, "c"), _as_int(k, "k")
    if not (1 <= k <= n):
        raise ValueError(f"pass@k needs 1 <= k <= n, got n={n}, k={k}")
    if not (0 <= c <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_1(correct_N: Sequence[bool], *, greedy: bool = False) -> float:
    """pass@1 of one task: the mean of its correctness bits; ValueError for none, or greedy (T = 0) with N != 1."""
    correct_N = np.asarray(correct_N, dtype=bool).reshape(-1)
    if correct_N.size == 0:
        raise ValueError("pass@1 of a task with no samples")
    if greedy and correct_N.size != 1:
        raise ValueError(f"a greedy (T = 0) task has exactly one sample, got N={correct_N.size}")
    return float(correct_N.mean())


def scored_mask(record: Mapping) -> np.ndarray:
    """N bools: the record's scored samples (status not "infra_error"; all of them without `statuses`)."""
    statuses = record.get("statuses")
    if statuses is None:
        return np.ones(len(record.get("correct", record.get("rewards", ()))), dtype=bool)
    return np.asarray([s != INFRA_ERROR for s in statuses], dtype=bool).reshape(-1)


def scored_only(records: Iterable[Mapping]) -> tuple[list[dict], dict[str, dict[str, int]]]:
    """(records cut to scored samples, {domain: {"infra_errors", "unscored_tasks", "samples"}}); ValueError: ragged."""
    kept, counts = [], {}
    for r in records:
        c = counts.setdefault(r.get("domain"), {"infra_errors": 0, "unscored_tasks": 0, "samples": 0})
        mask_N = scored_mask(r)
        rewards = r.get("rewards")
        if rewards is not None and len(rewards) != mask_N.size:
            raise ValueError(f"task {_key(r)}: {mask_N.size} statuses but {len(rewards)} rewards")
        c["samples"] += int(mask_N.size)
        if mask_N.all():
            kept.append(dict(r))
            continue
        c["infra_errors"] += int((~mask_N).sum())
        if not mask_N.any():
            c["unscored_tasks"] += 1
            continue
        kept.append({k: ([v for v, keep in zip(r[k], mask_N) if keep] if k in PER_SAMPLE_FIELDS and k in r else v)
                     for k, v in r.items()})
    return kept, counts


def correct_of(record: Mapping) -> np.ndarray:
    """The N correctness bits of a record: `correct`, else rewards >= 1.0; ValueError if missing or inconsistent."""
    rewards = record.get("rewards")
    if "correct" in record:
        correct_N = np.asarray(record["correct"], dtype=bool).reshape(-1)
        if rewards is not None and len(rewards) != correct_N.size:
            raise ValueError(f"task {_key(record)}: {correct_N.size} correct flags but {len(rewards)} rewards")
    elif rewards is not None:
        correct_N = np.asarray(rewards, dtype=np.float64).reshape(-1) >= 1.0
    else:
        raise ValueError(f"task {_key(record)} has neither 'correct' nor 'rewards'")
    if correct_N.size == 0:
        raise ValueError(f"task {_key(record)} has no samples")
    _require_scored(record)
    return correct_N


def task_pass_at_1(record: Mapping) -> float:
    """pass@1 of one record (`pass_at_1` of `correct_of(record)`, greedy if the record says so)."""
    return pass_at_1(correct_of(record), greedy=bool(record.get("greedy", False)))


def task_pass_at_k(record: Mapping, k: int) -> float:
    """Unbiased pass@k of one record (`pass_at_k` with n = its samples, c = its correct ones)."""
    correct_N = correct_of(record)
    return pass_at_k(correct_N.size, int(correct_N.sum()), k)


def task_mean_reward(record: Mapping) -> float:
    """The mean of one record's N rewards (scorer units). Raises ValueError without rewards."""
    return float(np.mean(_field(record, "rewards", np.float64)))


def task_format_rate(record: Mapping) -> float:
    """The share of one record's samples whose reply followed the answer format (`formatted`)."""
    return float(np.mean(_field(record, "formatted", bool)))


def task_mean_length(record: Mapping) -> float:
    """The mean response length of one record's samples, in tokens (`lengths`)."""
    return float(np.mean(_field(record, "lengths", np.float64)))


def task_truncation_rate(record: Mapping) -> float:
    """The share of one record's samples that hit their token budget (`truncated`)."""
    return float(np.mean(_field(record, "truncated", bool)))


TASK_METRICS: dict[str, Callable[[Mapping], float]] = {
    "pass@1": task_pass_at_1,
    "mean_reward": task_mean_reward,
    "format_rate": task_format_rate,
    "mean_length": task_mean_length,
    "truncation_rate": task_truncation_rate,
}


def metric_fn(name: str) -> Callable[[Mapping], float]:
    """The per-task function of a TASK_METRICS name or "pass@<k>" (k >= 1); KeyError for an unknown name."""
    if name in TASK_METRICS:
        return TASK_METRICS[name]
    if name.startswith("pass@") and name[5:].isdigit() and int(name[5:]) >= 1:
        return functools.partial(task_pass_at_k, k=int(name[5:]))
    raise KeyError(f"unknown metric {name!r}; known: {sorted(TASK_METRICS)} and pass@<k>")


def per_task(records: Sequence[Mapping], name: str) -> np.ndarray:
    """The T per-task values (float64) of metric `name` over `records`, in their order."""
    fn = metric_fn(name)
    return np.array([fn(r) for r in records], dtype=np.float64)


def by_domain(records: Iterable[Mapping]) -> dict[str, list[Mapping]]:
    """{domain: records sorted by task_id as JSON}, domains in first-seen order; ValueError: a bad or repeated key."""
    out: dict[str, list[Mapping]] = {}
    seen = set()
    for r in records:
        if "domain" not in r or "task_id" not in r:
            raise ValueError(f"a record needs 'domain' and 'task_id', got keys {sorted(r)}")
        key = (r["domain"], json.dumps(r["task_id"]))
        if key in seen:
            raise ValueError(f"task {_key(r)} appears twice")
        seen.add(key)
        out.setdefault(r["domain"], []).append(r)
    return {d: sorted(rs, key=lambda r: json.dumps(r["task_id"])) for d, rs in out.items()}


def summarize_domain(records: Sequence[Mapping], ks: Sequence[int] = ()) -> dict[str, float]:
    """A domain's summary: tasks, n_min, pass@1, pass@k (n_min >= k), mean reward, rates; ValueError: none or ragged."""
    if not records:
        raise ValueError("summary of a domain with no records")
    n_min = min(correct_of(r).size for r in records)
    out: dict[str, float] = {"tasks": len(records), "n_min": n_min,
                             "pass@1": float(per_task(records, "pass@1").mean())}
    for k in sorted(set(int(k) for k in ks) - {1}):
        if n_min >= k:
            out[f"pass@{k}"] = float(per_task(records, f"pass@{k}").mean())
    out["mean_reward"] = float(per_task(records, "mean_reward").mean())
    for name, field in OPTIONAL_FIELDS.items():
        have = sum(field in r for r in records)
        if have == len(records):
            out[name] = float(per_task(records, name).mean())
        elif have:
            raise ValueError(f"domain {records[0]['domain']!r}: {have} of {len(records)} records have {field!r}")
    return out


def summarize(records: Iterable[Mapping], ks: Sequence[int] = ()) -> dict[str, dict[str, float]]:
    """{domain: `summarize_domain`} over records of any number of domains (see `by_domain` for errors)."""
    return {d: summarize_domain(rs, ks) for d, rs in by_domain(records).items()}


def task_set_hash(records: Iterable[Mapping]) -> str:
    """The sha256 (hex) of the sorted (domain, task_id, prompt) JSON lines; ValueError for a bad or repeated task."""
    lines, seen = [], set()
    for r in records:
        missing = [f for f in ("domain", "task_id", "prompt") if f not in r]
        if missing:
            raise ValueError(f"task_set_hash needs domain, task_id and prompt; a record lacks {missing}")
        key = json.dumps([r["domain"], r["task_id"]], ensure_ascii=False)
        if key in seen:
            raise ValueError(f"task {key} appears twice")
        seen.add(key)
        lines.append(json.dumps([r["domain"], r["task_id"], r["prompt"]], ensure_ascii=False))
    return hashlib.sha256("\n".join(sorted(lines)).encode("utf-8")).hexdigest()


def _require_scored(record: Mapping) -> None:
    if not scored_mask(record).all():
        raise ValueError(f"task {_key(record)} has an unscored (infra_error) sample: pass the records through "
                         "scored_only first")


def _field(record: Mapping, field: str, dtype) -> np.ndarray:
    _require_scored(record)
    if field not in record:
        raise ValueError(f"task {_key(record)} has no {field!r}")
    values_N = np.asarray(record[field], dtype=dtype).reshape(-1)
    if values_N.size == 0:
        raise ValueError(f"task {_key(record)} has an empty {field!r}")
    return values_N


def _as_int(x, name: str) -> int:
    if isinstance(x, (bool, np.bool_)) or int(x) != x:
        raise ValueError(f"{name} must be an integer, got {x!r}")
    return int(x)


def _key(record: Mapping) -> str:
    return f"({record.get('domain')!r}, {record.get('task_id')!r})"
