"""The evaluation gate's loop side: `LoopGate` samples the suite against the initial policy and writes the outputs.

The decisions are `posttrain.eval.gate`'s; the schedule, outputs and metrics: docs/evaluation.md.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import time
from typing import Mapping, Sequence

from posttrain.errors import ConfigError
from posttrain.eval import compare as compare_lib
from posttrain.eval import gate as gate_lib
from posttrain.eval import records as records_lib
from posttrain.eval import report, suite as suite_lib
from posttrain.eval.metrics import task_set_hash
from posttrain.eval.runner import domain_key, sample_groups, suite_summary, task_record
from posttrain.infra import distributed, metrics as metrics_lib
from posttrain.rollout.episodes import Episode
from posttrain.generate.sampler import SamplingParams

GATE_DIR = "eval_gate"
SCORE = "eval/gate/score"


def budget_groups(built: Sequence[suite_lib.ResolvedDomain]) -> dict[tuple, list[suite_lib.ResolvedDomain]]:
    """The suite's domains by sampling budget (max_new_tokens, temperature, n, max_turns), groups sharing batches."""
    groups: dict[tuple, list] = {}
    for r in built:
        d = r.domain
        groups.setdefault((d.max_new_tokens, float(d.temperature), d.n, d.max_turns), []).append(r)
    return groups


def sample_suite(eval_settings, built: Sequence[suite_lib.ResolvedDomain], rollouter, policy) -> tuple[list, dict]:
    """(records of the built domains' tasks in suite order, {domain: seconds, "total": seconds}) under `policy`."""
    import jax

    t0, sampling = time.perf_counter(), eval_settings.sampling_config
    key, by_name = jax.random.key(eval_settings.seed), {r.domain.name: r.domain for r in built}
    seconds, records = dict.fromkeys(by_name, 0.0), {name: [] for name in by_name}

    def timed(chunk, s):
        for ep in chunk:
            seconds[ep.domain] += s / len(chunk)

    for (tokens, temperature, n, turns), group in budget_groups(built).items():
        sample_fn = rollouter.sample_fn(policy, SamplingParams(max_new_tokens=tokens, temperature=temperature))
        episodes = [Episode(r.spec.id, dict(r.spec.kwargs), r.source.get_task(i), seed=i, domain=r.domain.name)
                    for r in group for i in range(r.num_tasks)]
        local = [i for r in group for i in range(r.num_tasks)]
        sampled = sample_groups(sample_fn, rollouter.tokenizer, rollouter.runner, episodes,
                                batch_size=eval_settings.eval_config.batch_size, num_samples=n, max_turns=turns,
                                system_prompt=sampling.system_prompt, bucket=sampling.prompt_bucket, on_batch=timed,
                                key=domain_key(key, "+".join(r.domain.name for r in group)))
        for (ep, samples, prompt), i in zip(sampled, local):
            d = by_name[ep.domain]
            records[d.name].append(task_record(ep, i, samples, prompt, scorer=d.scorer, fmt=d.format,
                                               greedy=d.greedy, area=d.area))
    return [rec for name in by_name for rec in records[name]], {**seconds, "total": time.perf_counter() - t0}


def evaluation(label: str, records: list, seconds: dict, step: int | None, ks: Mapping, described: dict) -> dict:
    """One evaluation as `posttrain.eval.compare` and `records.write_evaluation` take it."""
    return {"label": label, "step": step, "records": records, "task_set_hash": task_set_hash(records),
            "summary": suite_summary(records, ks), "perf/eval_s": seconds["total"], "seconds": seconds,
            "suite": described}


def cut(folder: pathlib.Path, start: int) -> None:
    """Removes the gated steps after `start` (a resume runs them again; at 0 the baseline goes too)."""
    for path in sorted(folder.glob("step_*")):
        digits = path.name.removeprefix("step_")
        if digits.isdigit() and int(digits) > start:
            shutil.rmtree(path)
    if start == 0 and (folder / "baseline").is_dir():
        shutil.rmtree(folder / "baseline")


def _write(folder: pathlib.Path, ev: Mapping) -> None:
    records_lib.write_evaluation(folder, ev["records"], {k: v for k, v in ev.items() if k != "records"})


@dataclasses.dataclass
class LoopGate:
    """The gate of one run: its suite, the initial policy's evaluation, decisions, best (step, score), stop message."""

    settings: gate_lib.GateSettings
    folder: pathlib.Path
    built: list
    described: dict
    baseline: dict
    decisions: list = dataclasses.field(default_factory=list)
    best: tuple | None = None
    stopped: str | None = None

    @property
    def trained(self) -> list[str]:
        return [r.domain.name for r in self.built if r.domain.trained]

    @classmethod
    def open(cls, settings: gate_lib.GateSettings | None, workdir: pathlib.Path, eval_settings, rollouter, policy,
             start: int) -> "LoopGate | None":
        """The gate of a run (None without eval.suite), its baseline sampled or read back; ConfigError if unusable."""
        if settings is None:
            return None
        built, skipped = suite_lib.resolve(settings.suite)
        if not built:
            raise ConfigError(f"eval.suite={settings.suite.path!r}: every domain was skipped: {skipped}")
        described, folder = suite_lib.suite_dict(settings.suite, built, skipped), workdir / GATE_DIR
        if distributed.is_main_process():
            cut(folder, start)
        ks = {r.domain.name: r.domain.ks for r in built}
        if start == 0:
            baseline = evaluation("initial policy", *sample_suite(eval_settings, built, rollouter, policy), 0, ks,
                                  described)
            if distributed.is_main_process():
                _write(folder / "baseline", baseline)
        else:
            baseline = _read_baseline(folder, described)
        gate = cls(settings, folder, built, described, baseline)
        for path in sorted(folder.glob("step_*/decision.json")):
            gate.decisions.append(json.loads(path.read_text()))
            gate.best = (gate.decisions[-1]["best_step"], gate.decisions[-1]["best_score"])
        return gate

    def due(self, step: int, start: int, *, final: bool = False) -> bool:
        """Whether the suite runs after `step` steps; at the end (`final`) whenever the last step moved on ungated."""
        if final:
            return step > start and step not in {d["step"] for d in self.decisions} and not self.stopped
        return self.settings.due(step)

    def verdict(self, decision: gate_lib.GateDecision) -> str | None:
        """The warning for a regression beyond max_drop (None when the step passed); a "stop" sets `stopped`."""
        if decision.action == "pass":
            return None
        text = gate_lib.message(decision, str(self.folder / f"step_{decision.step:06d}" / "comparison.md"))
        if decision.action == "stop":
            self.stopped = text
        return text

    def summary(self) -> dict:
        return {"decisions": list(self.decisions), "best_step": self.best[0] if self.best else None,
                "best_score": self.best[1] if self.best else None, "baseline_s": self.baseline["perf/eval_s"]}

    def check(self, step: int, eval_settings, rollouter, policy) -> tuple[gate_lib.GateDecision | None, dict, float]:
        """(decision, eval/gate/* metrics, seconds) of the suite at `step`; decision None when nothing is scored."""
        ks = {r.domain.name: r.domain.ks for r in self.built}
        cand = evaluation(f"step {step}", *sample_suite(eval_settings, self.built, rollouter, policy), step, ks,
                          self.described)
        out = self.folder / f"step_{step:06d}"
        try:
            cmp = compare_lib.compare(self.baseline, cand, alpha=self.settings.gate_config.alpha)
        except compare_lib.NothingScoredError as e:  # a broken verifier or sandbox: no verdict, never a regression
            if distributed.is_main_process():
                _write(out / "candidate", cand)
            metrics_lib.log.warning(f"eval gate at step {step}: no verdict ({e}); training goes on")
            return None, {"eval/gate/unscored": 1.0}, cand["perf/eval_s"]
        rows = gate_lib.rows_of(cmp)
        s = self.settings.gate_config
        decision = gate_lib.decide(rows, step=step, action=s.action, max_drop=s.max_drop, trained=self.trained,
                                   best=self.best)
        self.best = (decision.best_step, decision.best_score)
        self.decisions.append(decision.to_dict())
        if distributed.is_main_process():
            _write(out / "candidate", cand)
            (out / "comparison.md").write_text(report.comparison_markdown(cmp))
            (out / "comparison.json").write_text(json.dumps(report.comparison_dict(cmp), indent=2))
            report.forest_plot(cmp, out / "forest.png")
            (out / "decision.json").write_text(json.dumps(decision.to_dict(), indent=2))
        return decision, gate_lib.gate_metrics(decision, rows), cand["perf/eval_s"]


def _read_baseline(folder: pathlib.Path, described: dict) -> dict:
    """The stored initial-policy evaluation; ConfigError when it is absent or was sampled for another suite."""
    try:
        records, results = records_lib.read_evaluation(folder / "baseline")
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"eval.suite: this run has no usable baseline in {folder / 'baseline'} ({e}); the gate "
                          "samples the initial policy before the first update: start a new run with eval.suite") from None
    if json.dumps(results.get("suite"), sort_keys=True) != json.dumps(described, sort_keys=True, default=str):
        raise ConfigError(f"eval.suite: {folder / 'baseline'} was sampled for another suite or suite file version "
                          "(the domains or their settings differ); start a new run to gate on this suite")
    return {**results, "records": records}
