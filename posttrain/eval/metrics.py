"""Evaluation metrics over per-task records: unbiased pass@k, pass@1, mean reward, format, length, truncation.

Dimension legend (shape suffixes): T tasks of one domain, N samples of one task (n in the formulas), K a k value.

A per-task record is a mapping with
  domain     str, the task's domain
  task_id    str | int, unique within its domain
  rewards    N floats, the scorer's reward of each sample
  correct    N bools (optional; default: reward >= 1.0, the "env" scorer rule of `posttrain.eval.runner`)
  prompt     str (needed only by `task_set_hash`)
  formatted  N bools (optional): the reply followed the required answer format
  lengths    N numbers (optional): response length of each sample, in tokens
  truncated  N bools (optional): the sample hit its token budget
  greedy     bool (optional): sampled at temperature 0, so exactly one sample is meaningful
  statuses   N strs (optional): the env's status of each sample; an "infra_error" sample (the env or its sandbox
             failed: `envs.verify.answers.STATUSES`) is unscored, never a wrong answer

Unscored samples: `scored_only` drops the infra-error samples from every per-sample field and the tasks left with
no scored sample, and counts both per domain; every summary, loop metric and paired comparison is computed on what
it keeps (a metric function given a record with an unscored sample raises, so none is counted by accident).

Every metric is a per-task value (`TASK_METRICS`, or "pass@<k>" through `metric_fn`); a domain's value is the
unweighted mean over its tasks (each task weighs the same, whatever its N). All values are floats in [0, 1] except
`mean_length` (tokens) and `mean_reward` (the scorer's units).
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
    """Unbiased pass@k of one task from n samples of which c are correct.

    pass@k = 1 - C(n - c, k) / C(n, k)  (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
    arXiv:2107.03374, eq. 1), computed as in their numpy snippet: 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never
    forms the binomials (stable for n in the thousands). It is the probability that k samples drawn without
    replacement from the n contain a correct one; unbiased for n >= k (Chen et al. recommend n well above k).
    Raises ValueError unless 1 <= k <= n and 0 <= c <= n (integers).
    """
    n, c, k = _as_int(n, "n"), _as_int(c, "c"), _as_int(k, "k")
    if not (1 <= k <= n):
        raise ValueError(f"pass@k needs 1 <= k <= n, got n={n}, k={k}")
    if not (0 <= c <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_1(correct_N: Sequence[bool], *, greedy: bool = False) -> float:
    """pass@1 of one task: the mean of its N correctness bits (the unbiased pass@k at k = 1, c / n).

    greedy: the samples were drawn at temperature 0, so the task has exactly one sample and pass@1 is that sample.
    Raises ValueError for no samples, or for greedy with N != 1 (repeated greedy samples are duplicates).
    """
    correct_N = np.asarray(correct_N, dtype=bool).reshape(-1)
    if correct_N.size == 0:
        raise ValueError("pass@1 of a task with no samples")
    if greedy and correct_N.size != 1:
        raise ValueError(f"a greedy (T = 0) task has exactly one sample, got N={correct_N.size}")
    return float(correct_N.mean())


def scored_mask(record: Mapping) -> np.ndarray:
    """N bools: the record's samples that were scored (status other than "infra_error"; all of them without
    `statuses`)."""
    statuses = record.get("statuses")
    if statuses is None:
        return np.ones(len(record.get("correct", record.get("rewards", ()))), dtype=bool)
    return np.asarray([s != INFRA_ERROR for s in statuses], dtype=bool).reshape(-1)


def scored_only(records: Iterable[Mapping]) -> tuple[list[dict], dict[str, dict[str, int]]]:
    """(the records cut to their scored samples, {domain: {"infra_errors": unscored samples, "unscored_tasks":
    tasks with no scored sample, "samples": all samples}}). Each kept record keeps only its scored samples in every
    per-sample field (PER_SAMPLE_FIELDS); a record with none is left out. Every domain of `records` has a count
    entry, zeros included. Raises ValueError for a record whose `statuses` and `rewards` differ in length."""
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
    """The N correctness bits of a record: its `correct`, else `rewards >= 1.0`. Raises ValueError when the record
    has neither, no samples, or `correct` and `rewards` of different lengths."""
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
    """The per-task function of metric `name`: a TASK_METRICS key, or "pass@<k>" for any integer k >= 1.
    Raises KeyError for an unknown name."""
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
    """{domain: [record]} in first-seen order of domains, each domain's records sorted by task_id (as JSON text, so
    int and str ids never compare). Raises ValueError for a record without domain / task_id, or a repeated
    (domain, task_id)."""
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
    """One domain's summary: tasks (T), n_min (the fewest samples of any task), pass@1, pass@k for each k in `ks`
    with n_min >= k (others left out), mean_reward, and format_rate / mean_length / truncation_rate when every
    record has the field (left out when none has it). Each value is the mean over tasks of the per-task value.
    Raises ValueError for no records, or an optional field present in some records only."""
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
    """The content hash of a task set: sha256 (hex) over the sorted (domain, task_id, prompt) tuples, each
    serialized as a JSON list (so task ids 1 and "1" differ) and joined by newlines. Records with the same
    tasks give the same hash in any order and with any replies, so two evaluations compare only when it agrees.
    Raises ValueError for a record without domain, task_id or prompt, or a repeated (domain, task_id)."""
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
