"""Paired comparison of two evaluations of the same task set: per-domain tests, intervals and verdicts.

Shapes: the legend in `posttrain.types`. Differences are candidate - baseline; the tests: docs/evaluation.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import warnings
from typing import Mapping, Sequence

import numpy as np
from scipy import stats

from posttrain.eval.metrics import by_domain, correct_of, per_task, scored_only, task_set_hash

VERDICTS = ("improved", "no change", "regressed")


class NothingScoredError(ValueError):
    """No task of the two evaluations is scored on both sides (every sample of one side ended in infra_error)."""


@dataclasses.dataclass(frozen=True)
class MetricComparison:
    """One metric of one domain: means, diff, bootstrap ci, mde, test, p-values; verdict None: it does not decide.

    ci is the unadjusted interval at the comparison's confidence; ci_adjusted the family-wise one (Bonferroni:
    confidence 1 - alpha / m over the m domains the metric is tested on), what the forest plot draws thick."""

    metric: str
    baseline: float
    candidate: float
    diff: float
    ci: tuple[float, float]
    mde: float
    test: str
    p: float | None
    p_holm: float | None
    verdict: str | None
    ci_adjusted: tuple[float, float] | None = None


@dataclasses.dataclass(frozen=True)
class DomainComparison:
    """One domain: wins / losses (tasks where the candidate's pass@1 is higher / lower), both metrics, unscored."""

    domain: str
    tasks: int
    wins: int
    losses: int
    partial_credit: bool
    pass_at_1: MetricComparison
    mean_reward: MetricComparison
    unscored: int = 0

    @property
    def verdict(self) -> str:
        return self.pass_at_1.verdict


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Two evaluations compared: the task-set hash, the settings, a DomainComparison per tested domain (by name)."""

    task_set_hash: str
    alpha: float
    confidence: float
    power: float
    n_resamples: int
    seed: int
    domains: tuple[DomainComparison, ...]
    unscored_domains: tuple[str, ...] = ()


def mcnemar_exact(losses: int, wins: int) -> float:
    """Exact two-sided McNemar p-value (McNemar 1947): binomtest(wins, losses + wins, 0.5); ValueError if negative."""
    if losses < 0 or wins < 0:
        raise ValueError(f"discordant counts must be >= 0, got losses={losses}, wins={wins}")
    if losses + wins == 0:
        return 1.0
    return float(stats.binomtest(int(wins), int(losses + wins), 0.5, alternative="two-sided").pvalue)


def paired_permutation_p(base_T: np.ndarray, cand_T: np.ndarray, *, n_resamples: int = 9999, seed: int = 0) -> float:
    """Two-sided p-value of the paired sign-flip permutation test of mean(cand_T - base_T); 1.0 for no difference."""
    base_T, cand_T = _pair(base_T, cand_T)
    if not np.any(cand_T != base_T):
        return 1.0
    res = stats.permutation_test((base_T, cand_T), _mean_diff, permutation_type="samples", vectorized=True,
                                 n_resamples=n_resamples, alternative="two-sided", rng=np.random.default_rng(seed))
    return float(min(1.0, res.pvalue))


def holm(pvalues_M: Sequence[float], alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(reject_M, p_adj_M): Holm's step-down adjustment (Holm 1979) at level alpha; ValueError for bad values."""
    from statsmodels.stats.multitest import multipletests

    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    p_M = np.asarray(pvalues_M, dtype=np.float64).reshape(-1)
    if p_M.size == 0:
        return np.zeros(0, dtype=bool), np.zeros(0)
    if np.any(~np.isfinite(p_M)) or np.any((p_M < 0) | (p_M > 1)):
        raise ValueError(f"p-values must be in [0, 1], got {p_M.tolist()}")
    with _without_gc_collect():
        reject_M, p_adj_M, _, _ = multipletests(p_M, alpha=alpha, method="holm")
    return reject_M.astype(bool), p_adj_M.astype(np.float64)


@contextlib.contextmanager
def _without_gc_collect():
    """`gc.collect` as a no-op: `multipletests` ends with a full collection that dominated a comparison's time."""
    saved = gc.collect
    gc.collect = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        gc.collect = saved


def paired_bootstrap_ci(base_T: np.ndarray, cand_T: np.ndarray, *, confidence: float = 0.95,
                        n_resamples: int = 9999, seed: int = 0) -> tuple[float, float]:
    """Paired BCa bootstrap interval (Efron 1987) of mean(cand_T - base_T) ([d, d] if constant); ValueError if bad."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    base_T, cand_T = _pair(base_T, cand_T)
    diff_T = cand_T - base_T
    if np.ptp(diff_T) == 0.0:
        return float(diff_T[0]), float(diff_T[0])
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DegenerateDataWarning on near-constant data: the fallback handles it
            res = stats.bootstrap((base_T, cand_T), _mean_diff, paired=True, vectorized=True, method=method,
                                  confidence_level=confidence, n_resamples=n_resamples,
                                  rng=np.random.default_rng(seed))
        lo, hi = res.confidence_interval
        if np.isfinite(lo) and np.isfinite(hi):
            return float(lo), float(hi)
    raise AssertionError("the percentile bootstrap interval of non-constant data is finite")  # pragma: no cover


def min_detectable_effect(diff_T: np.ndarray, *, alpha: float = 0.05, power: float = 0.8, tests: int = 1) -> float:
    """The smallest true mean difference a two-sided test at level alpha / tests detects with probability `power`.

    MDE = (z_{1 - alpha / (2 tests)} + z_{power}) sigma_d / sqrt(T) (Chow et al. 2017, sec. 3.1; Miller 2024), with
    sigma_d the SD of the T differences floored at 1 / sqrt(T). ValueError for no pairs or bad settings.
    """
    if not (0.0 < alpha < 1.0 and 0.0 < power < 1.0 and tests >= 1):
        raise ValueError(f"need 0 < alpha, power < 1 and tests >= 1, got alpha={alpha}, power={power}, tests={tests}")
    diff_T = np.asarray(diff_T, dtype=np.float64).reshape(-1)
    t = diff_T.size
    if t == 0:
        raise ValueError("min_detectable_effect of no pairs")
    sigma = max(float(np.std(diff_T, ddof=1)) if t > 1 else 0.0, 1.0 / np.sqrt(t))
    z = stats.norm.ppf(1.0 - alpha / (2.0 * tests)) + stats.norm.ppf(power)
    return float(z * sigma / np.sqrt(t))


def verdict(diff: float, significant: bool) -> str:
    """"improved" / "regressed" for a significant positive / negative difference, else "no change"."""
    if significant and diff > 0:
        return "improved"
    if significant and diff < 0:
        return "regressed"
    return "no change"


def compare(baseline, candidate, *, alpha: float = 0.05, confidence: float | None = None, power: float = 0.8,
            n_resamples: int = 9999, seed: int = 0) -> Comparison:
    """Paired comparison of two evaluations of the same task set at family-wise level alpha (docs/evaluation.md).

    ValueError for a missing or mismatched hash or different task sets; NothingScoredError when nothing pairs.
    """
    confidence = 1.0 - alpha if confidence is None else confidence
    base, base_hash = _evaluation(baseline, "baseline")
    cand, cand_hash = _evaluation(candidate, "candidate")
    _same_tasks(base, cand)
    if base_hash != cand_hash:
        raise ValueError(f"task set hashes differ: baseline {base_hash}, candidate {cand_hash}; the evaluations "
                         "ran different tasks (or prompts) and are not paired")
    base_scored, cand_scored = _scored_by_task(base), _scored_by_task(cand)
    rows, unscored_domains = [], []
    for domain in sorted(base):
        pairs = sorted(set(base_scored.get(domain, {})) & set(cand_scored.get(domain, {})))
        if not pairs:
            unscored_domains.append(domain)
            continue
        b, c = [base_scored[domain][t] for t in pairs], [cand_scored[domain][t] for t in pairs]
        n_b = np.array([correct_of(r).size for r in b])
        n_c = np.array([correct_of(r).size for r in c])
        pb, pc = per_task(b, "pass@1"), per_task(c, "pass@1")
        rb, rc = per_task(b, "mean_reward"), per_task(c, "mean_reward")
        partial = not all(np.isin(np.asarray(r["rewards"], float), (0.0, 1.0)).all() for r in (*b, *c))
        binary = bool(np.all(n_b == 1) and np.all(n_c == 1))
        wins, losses = int(np.sum(pc > pb)), int(np.sum(pc < pb))
        p = mcnemar_exact(losses, wins) if binary else paired_permutation_p(pb, pc, n_resamples=n_resamples, seed=seed)
        rows.append(dict(domain=domain, pb=pb, pc=pc, rb=rb, rc=rc, partial=partial, wins=wins, losses=losses, p=p,
                         test="mcnemar" if binary else "permutation", unscored=len(base[domain]) - len(pairs)))
    if not rows:
        raise NothingScoredError(f"no task is scored on both sides: every sample of {unscored_domains} on one side or the "
                         "other ended in infra_error (the env or its sandbox failed; records' statuses)")
    reject_M, p_adj_M = holm([r["p"] for r in rows], alpha)
    m_partial = sum(r["partial"] for r in rows)
    domains = []
    for row, reject, p_adj in zip(rows, reject_M, p_adj_M):
        pb, pc, rb, rc = row["pb"], row["pc"], row["rb"], row["rc"]
        d1 = float(pc.mean() - pb.mean())
        pass1 = MetricComparison(
            "pass@1", float(pb.mean()), float(pc.mean()), d1,
            paired_bootstrap_ci(pb, pc, confidence=confidence, n_resamples=n_resamples, seed=seed),
            min_detectable_effect(pc - pb, alpha=alpha, power=power, tests=len(rows)),
            row["test"], row["p"], float(p_adj), verdict(d1, bool(reject)),
            paired_bootstrap_ci(pb, pc, confidence=1.0 - alpha / len(rows), n_resamples=n_resamples, seed=seed))
        dr = float(rc.mean() - rb.mean())
        reward_verdict, adjusted = None, None
        if row["partial"]:
            lo, hi = adjusted = paired_bootstrap_ci(rb, rc, confidence=1.0 - alpha / m_partial, n_resamples=n_resamples,
                                                    seed=seed)
            reward_verdict = verdict(dr, lo > 0 or hi < 0)
        reward = MetricComparison(
            "mean_reward", float(rb.mean()), float(rc.mean()), dr,
            paired_bootstrap_ci(rb, rc, confidence=confidence, n_resamples=n_resamples, seed=seed),
            min_detectable_effect(rc - rb, alpha=alpha, power=power, tests=max(1, m_partial)),
            "bootstrap", None, None, reward_verdict, adjusted)
        domains.append(DomainComparison(row["domain"], len(pb), row["wins"], row["losses"], row["partial"], pass1,
                                        reward, row["unscored"]))
    return Comparison(base_hash, alpha, confidence, power, n_resamples, seed, tuple(domains), tuple(unscored_domains))


def _scored_by_task(evaluation: Mapping[str, list]) -> dict[str, dict[str, Mapping]]:
    """{domain: {task_id as JSON: the record cut to its scored samples}} of the tasks with a scored sample."""
    kept, _ = scored_only([r for rs in evaluation.values() for r in rs])
    out: dict[str, dict[str, Mapping]] = {}
    for r in kept:
        out.setdefault(r["domain"], {})[json.dumps(r["task_id"])] = r
    return out


def _evaluation(evaluation, name: str) -> tuple[dict[str, list[Mapping]], str]:
    """({domain: records sorted by task_id}, task_set_hash) of one evaluation, checking its recorded hash."""
    if isinstance(evaluation, Mapping):
        if "records" not in evaluation:
            raise ValueError(f"{name}: an evaluation mapping needs 'records', got keys {sorted(evaluation)}")
        records, recorded = list(evaluation["records"]), evaluation.get("task_set_hash")
    else:
        records, recorded = list(evaluation), None
    if not records:
        raise ValueError(f"{name} has no records")
    has_prompts = all("prompt" in r for r in records)
    computed = task_set_hash(records) if has_prompts else None
    if recorded is None and computed is None:
        raise ValueError(f"{name}: no task_set_hash recorded and its records carry no prompts to compute one")
    if recorded is not None and computed is not None and recorded != computed:
        raise ValueError(f"{name}: recorded task_set_hash {recorded} does not match its records' ({computed})")
    return by_domain(records), recorded if recorded is not None else computed


def _same_tasks(base: Mapping[str, list], cand: Mapping[str, list]) -> None:
    keys = {name: {(d, json.dumps(r["task_id"])) for d, rs in ev.items() for r in rs}
            for name, ev in (("baseline", base), ("candidate", cand))}
    only_b, only_c = keys["baseline"] - keys["candidate"], keys["candidate"] - keys["baseline"]
    if only_b or only_c:
        raise ValueError(f"the task sets differ: {len(only_b)} (domain, task_id) only in the baseline "
                         f"(e.g. {sorted(only_b)[:3]}), {len(only_c)} only in the candidate (e.g. {sorted(only_c)[:3]})")


def _pair(base_T, cand_T) -> tuple[np.ndarray, np.ndarray]:
    base_T = np.asarray(base_T, dtype=np.float64).reshape(-1)
    cand_T = np.asarray(cand_T, dtype=np.float64).reshape(-1)
    if base_T.size != cand_T.size or base_T.size == 0:
        raise ValueError(f"paired samples need equal, non-zero lengths, got {base_T.size} and {cand_T.size}")
    return base_T, cand_T


def _mean_diff(base, cand, axis=-1):
    return np.mean(cand - base, axis=axis)
