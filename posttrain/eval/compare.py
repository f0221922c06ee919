"""Paired comparison of two evaluations of the same task set: per-domain tests, intervals and verdicts.

Dimension legend (shape suffixes): T tasks of one domain (the pairs), M domains (the tests Holm adjusts over).

An evaluation is a mapping {"records": [per-task record], "task_set_hash": str} (`posttrain.eval.metrics` gives the
record fields and `task_set_hash`), or a bare sequence of records carrying prompts (its hash is then computed).
Differences are always candidate - baseline, per task, so "improved" means the candidate is better.

Unscored samples (status "infra_error": the env or its sandbox failed) are left out on each side
(`metrics.scored_only`), and a task with no scored sample on either side leaves the pairing (counted per domain as
`unscored`); a domain left with no pair is not tested (`Comparison.unscored_domains`), so a broken verifier never
reads as a model that scores 0.

Per domain and metric (pass@1; mean reward):
  - the per-task values of each side and their paired bootstrap interval of the mean difference
    (`scipy.stats.bootstrap`, paired=True, BCa, fixed seed);
  - pass@1 test: exact McNemar (`scipy.stats.binomtest` on the discordant pairs) when every task has one sample on
    each side; with N > 1 samples (fractional per-task pass@1) a paired sign-flip permutation test of the mean
    difference (`scipy.stats.permutation_test`, permutation_type="samples"). The M p-values are Holm-adjusted
    (`statsmodels.stats.multitest.multipletests`, method="holm"), which controls the family-wise error at alpha;
  - mean-reward verdict, on partial-credit domains only (a reward outside {0, 1}): the paired bootstrap interval at
    confidence 1 - alpha / M' (Bonferroni over the M' partial-credit domains) excluding 0;
  - the minimum detectable effect at the domain's size (`min_detectable_effect`).
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
    """One metric of one domain. baseline / candidate: domain means; diff = candidate - baseline; ci: paired
    bootstrap interval of diff at the comparison's confidence; mde: `min_detectable_effect`; test: "mcnemar" |
    "permutation" | "bootstrap"; p / p_holm: raw and Holm-adjusted p-values (None for bootstrap verdicts);
    verdict: one of VERDICTS, or None where this metric does not decide (mean reward of a 0/1-reward domain)."""

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


@dataclasses.dataclass(frozen=True)
class DomainComparison:
    """One domain: tasks (T pairs); wins / losses: tasks where the candidate's pass@1 is higher / lower (McNemar's
    discordant pairs when N = 1); partial_credit: a reward outside {0, 1} on either side; verdict: pass@1's;
    unscored: tasks left out of the pairs because one side has no scored sample of them."""

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
    """The comparison of two evaluations: their common task_set_hash, the settings, one DomainComparison per
    domain with a scored pair (sorted by name), and the domains with none (`unscored_domains`, sorted)."""

    task_set_hash: str
    alpha: float
    confidence: float
    power: float
    n_resamples: int
    seed: int
    domains: tuple[DomainComparison, ...]
    unscored_domains: tuple[str, ...] = ()


def mcnemar_exact(losses: int, wins: int) -> float:
    """Exact two-sided McNemar p-value: under H0 each of the losses + wins discordant pairs goes either way with
    probability 1/2, p = binomtest(wins, losses + wins, 0.5).pvalue (McNemar 1947; the exact form, e.g. Fagerland,
    Lydersen & Laake 2013, BMC Med. Res. Methodol. 13:91). 1.0 with no discordant pair. Raises ValueError for a
    negative count."""
    if losses < 0 or wins < 0:
        raise ValueError(f"discordant counts must be >= 0, got losses={losses}, wins={wins}")
    if losses + wins == 0:
        return 1.0
    return float(stats.binomtest(int(wins), int(losses + wins), 0.5, alternative="two-sided").pvalue)


def paired_permutation_p(base_T: np.ndarray, cand_T: np.ndarray, *, n_resamples: int = 9999, seed: int = 0) -> float:
    """Two-sided p-value of the paired sign-flip permutation test of mean(cand_T - base_T) (values swapped within
    pairs; exact when 2^T <= n_resamples), by `scipy.stats.permutation_test`. 1.0 when every difference is 0."""
    base_T, cand_T = _pair(base_T, cand_T)
    if not np.any(cand_T != base_T):
        return 1.0
    res = stats.permutation_test((base_T, cand_T), _mean_diff, permutation_type="samples", vectorized=True,
                                 n_resamples=n_resamples, alternative="two-sided", rng=np.random.default_rng(seed))
    return float(min(1.0, res.pvalue))


def holm(pvalues_M: Sequence[float], alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Holm's step-down adjustment (Holm 1979, Scand. J. Stat. 6:65-70) of M p-values at family-wise level alpha:
    sort p ascending, p_adj(i) = max_{j <= i} min(1, (M - j + 1) p(j)); reject where p_adj < alpha. By
    `statsmodels.stats.multitest.multipletests(method="holm")`. Returns (reject_M bool, p_adj_M float64).
    Raises ValueError for alpha outside (0, 1) or a p-value outside [0, 1]."""
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
    """statsmodels' Holm branch ends with a full `gc.collect()` (statsmodels 0.15, multitest.py: `import gc` in
    `multipletests`), measured 0.42 s a call in a test process and more in one holding a model, most of a power
    run's comparison time. `gc.collect` is a no-op while `multipletests` runs (automatic collection is untouched)."""
    saved = gc.collect
    gc.collect = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        gc.collect = saved


def paired_bootstrap_ci(base_T: np.ndarray, cand_T: np.ndarray, *, confidence: float = 0.95,
                        n_resamples: int = 9999, seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap interval of mean(cand_T - base_T): `scipy.stats.bootstrap` with paired=True (tasks resampled
    with both sides together), BCa (Efron 1987), rng seeded by `seed`; the percentile interval where BCa is
    undefined. When all T differences are equal (e.g. all pairs concordant) the interval is [d, d], never NaN.
    Raises ValueError for unequal lengths, no pairs, or confidence outside (0, 1)."""
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
    """The smallest true mean difference a two-sided test at level alpha / tests (Bonferroni: Holm's first, most
    stringent step) detects with probability `power`, at this domain's T pairs:

        MDE = (z_{1 - alpha / (2 tests)} + z_{power}) * sigma_d / sqrt(T)

    the normal-approximation sample size for a paired mean difference, n = (z_{1-a/2} + z_{1-b})^2 sigma_d^2 /
    delta^2 (Chow, Shao, Wang & Lokhnygina, "Sample Size Calculations in Clinical Research", 3rd ed. 2017, sec.
    3.1; Miller 2024, "Adding Error Bars to Evals", arXiv:2411.00640, sec. 5), solved for delta. sigma_d is the
    sample SD (ddof = 1) of the T per-task differences, floored at 1 / sqrt(T), the SD of one discordant pair
    among T (so that a comparison with no differences does not claim MDE 0). For pass@1 with one sample per task,
    sigma_d^2 ~ the discordant share (Connor 1987, Biometrics 43:207). Units: those of the metric.
    Raises ValueError for no pairs, alpha or power outside (0, 1), or tests < 1."""
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
    """"improved" / "regressed" for a significant positive / negative candidate - baseline difference, else
    "no change"."""
    if significant and diff > 0:
        return "improved"
    if significant and diff < 0:
        return "regressed"
    return "no change"


def compare(baseline, candidate, *, alpha: float = 0.05, confidence: float | None = None, power: float = 0.8,
            n_resamples: int = 9999, seed: int = 0) -> Comparison:
    """Paired comparison of two evaluations of the same task set (see the module docstring for the tests).

    alpha: family-wise level of the verdicts; confidence: of the reported intervals (default 1 - alpha); power: of
    the MDE; n_resamples / seed: of the bootstrap and permutation tests (the same seed gives the same result).
    Raises ValueError when an evaluation has no hash and no prompts to compute it, a recorded hash disagrees with
    its records' prompts, the two hashes differ or the (domain, task_id) sets differ (the message names them);
    NothingScoredError (a ValueError) when no task is scored on both sides.
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
            row["test"], row["p"], float(p_adj), verdict(d1, bool(reject)))
        dr = float(rc.mean() - rb.mean())
        reward_verdict = None
        if row["partial"]:
            lo, hi = paired_bootstrap_ci(rb, rc, confidence=1.0 - alpha / m_partial, n_resamples=n_resamples, seed=seed)
            reward_verdict = verdict(dr, lo > 0 or hi < 0)
        reward = MetricComparison(
            "mean_reward", float(rb.mean()), float(rc.mean()), dr,
            paired_bootstrap_ci(rb, rc, confidence=confidence, n_resamples=n_resamples, seed=seed),
            min_detectable_effect(rc - rb, alpha=alpha, power=power, tests=max(1, m_partial)),
            "bootstrap", None, None, reward_verdict)
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
