"""`posttrain eval --suite` and `--from_records` (docs/commands.md), and the Config that evaluates a run of any kind."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Mapping

from posttrain.config import Config, ConfigError
from posttrain.eval import compare as compare_lib
from posttrain.eval import context_length
from posttrain.eval import records as records_lib
from posttrain.eval import report, suite as suite_lib
from posttrain.infra.partitioning import use_rules
from posttrain.recipes import grpo
from posttrain.eval.gate_hook import evaluation as _evaluation, sample_suite
from posttrain.runs.lookup import require_checkpoint
from posttrain.config.plan import RunPlan, make_run_plan
from posttrain.runs.read import OFFLINE_KINDS, OFFLINE_STATE_SECTIONS, refuse, run_kind


def run_plan_of(checkpoint: str | pathlib.Path, cfg: Config | None = None, flag: str = "--checkpoint") -> RunPlan:
    """The run plan that evaluates the run in `checkpoint`, of any kind (`reading_config`), with its workdir.

    Raises RunNotFoundError (naming `flag`) without a complete checkpoint, ConfigError for a run it cannot evaluate."""
    require_checkpoint(checkpoint, flag)
    return make_run_plan(reading_config(checkpoint, cfg, "eval --suite", suite=True), workdir=str(checkpoint))


def model_positions(plan: RunPlan) -> int:
    """The policy's positions (`ModelConfig.max_position`), read from its preset or model file without weights."""
    source = plan.policy
    if source.preset:
        return source.preset_config().max_position
    from posttrain.checkpoints import gguf as gguf_lib, hf_config, hub

    path = pathlib.Path(hub.resolve(source.path or gguf_lib.default_model_path()))
    hf = json.loads((path / "config.json").read_text()) if path.is_dir() else gguf_lib.read_hf_config(path)[0]
    return hf_config.config_from_hf(hf).max_position


def evaluate_policies(plan: RunPlan, built, *, with_base: bool, sampling_plan: RunPlan | None = None) -> dict:
    """{"base"?: (records, seconds, 0), "run": (records, seconds, step)}: the suite (`built`) sampled by the run.

    "base": its initial policy (with `with_base`); "run": its newest checkpoint; both with `sampling_plan`'s eval
    settings (default `plan`'s), none of the run's own envs built."""
    out = {}
    with use_rules(plan.rules):
        rollouter, learner, _ = grpo.build(plan, reading=True, restore=False, held_out=False)
        try:
            if with_base:
                out["base"] = (*sample_suite((sampling_plan or plan).eval_settings, built, rollouter, learner.policy()), 0)
            learner.restore()
            out["run"] = (*sample_suite((sampling_plan or plan).eval_settings, built, rollouter, learner.policy()), learner.step)
        finally:
            learner.close()
            rollouter.close()
    return out


def write_report(out: pathlib.Path, evaluations: Mapping[str, dict], alpha: float, skipped: Mapping[str, str]) -> str:
    """Writes each evaluation's folder and, with a baseline, the comparison files; returns the printed text."""
    texts = []
    for role, ev in evaluations.items():
        records_lib.write_evaluation(out / role, ev["records"], {k: v for k, v in ev.items() if k != "records"})
        by_domain = ", ".join(f"{d} {s:.0f}" for d, s in ev["seconds"].items() if d != "total")
        texts.append(report.summary_markdown(ev["summary"], f"{role}: {ev['label']} (step {ev['step']}), "
                                             f"{ev['perf/eval_s']:.0f} s" + (f" ({by_domain})" if by_domain else "")))
    if skipped:
        texts.append("skipped: " + "; ".join(f"{d} ({why})" for d, why in skipped.items()) + "\n")
    compared = None
    if "baseline" in evaluations:
        cmp = compare_lib.compare(evaluations["baseline"], evaluations["candidate"], alpha=alpha)
        md, compared = report.comparison_markdown(cmp), report.comparison_dict(cmp)
        (out / "comparison.md").write_text(md)
        (out / "comparison.json").write_text(json.dumps(compared, indent=2))
        report.forest_plot(cmp, out / "forest.png")
        mdes = sorted(d.pass_at_1.mde for d in cmp.domains)
        texts += [md, f"suite size: {sum(d.tasks for d in cmp.domains)} tasks in {len(cmp.domains)} domains; "
                      f"minimum detectable effect on pass@1 (power {cmp.power:g}, alpha {alpha:g}/{len(mdes)}): "
                      f"{mdes[0]:.3f} to {mdes[-1]:.3f} by domain (median {mdes[len(mdes) // 2]:.3f})\n"]
    if context_length.has_buckets([*evaluations["candidate"]["summary"]["domains"], *skipped]):
        texts.append(context_length.write_context_report(out, evaluations, skipped, compared))
    return "\n".join(texts)


def evaluate_suite(suite_path: str, checkpoint: str, *, baseline: str | None = None, cfg: Config | None = None,
                   limit: int | None = None, domains: str | None = None, out: str | None = None) -> dict:
    """Runs the suite on `checkpoint` (and `baseline`: "base" or a run's workdir), writes the report; returns `_result`.

    Raises RunNotFoundError for a run without a complete checkpoint, ValueError for a malformed suite or selection."""
    suite = suite_lib.select(suite_lib.load_suite(suite_path), limit=limit, domains=domains)
    plan = run_plan_of(checkpoint, cfg)
    base_plan = run_plan_of(baseline, flag="--baseline") if baseline not in (None, "base") else None
    too_long = {}
    if any(suite_lib.positions_needed(d) for d in suite.domains):  # the model file is read only when it matters
        suite, too_long = suite_lib.fit_positions(suite, model_positions(plan))
    built, skipped = suite_lib.resolve(suite)
    skipped = {**too_long, **skipped}
    if not built:
        raise ValueError(f"suite {suite.name!r}: every domain was skipped: {skipped}")
    described = suite_lib.suite_dict(suite, built, skipped)
    ks = {r.domain.name: r.domain.ks for r in built}
    ran = evaluate_policies(plan, built, with_base=baseline == "base")
    evaluations = {"candidate": _evaluation(str(checkpoint), *ran["run"], ks, described)}
    if baseline == "base":
        evaluations["baseline"] = _evaluation("base", *ran["base"], ks, described)
    elif base_plan is not None:
        other = evaluate_policies(base_plan, built, with_base=False, sampling_plan=plan)["run"]
        evaluations["baseline"] = _evaluation(str(baseline), *other, ks, described)
    evaluations = dict(sorted(evaluations.items()))  # baseline first
    folder = pathlib.Path(out) if out else default_out(checkpoint, suite.name, evaluations["candidate"]["step"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "suite.json").write_text(json.dumps(described, indent=2))
    text = write_report(folder, evaluations, suite.alpha, skipped)
    return _result(folder, text, evaluations, skipped)


def default_out(checkpoint, suite_name: str, step: int) -> pathlib.Path:
    """The default report folder, eval_reports/<run name>/<suite name>-step<step>, outside the run (only read)."""
    return pathlib.Path("eval_reports") / pathlib.Path(checkpoint).resolve().name / f"{suite_name}-step{step}"


def _result(folder, text, evaluations, skipped) -> dict:
    """{"out", "text", "skipped", "task_set_hash", "unscored", "counts"?}: "unscored" = {role: [domain]} of the
    domains no task of which was scored in that evaluation (every sample an infra_error), empty roles left out."""
    unscored = {role: [d for d, s in ev["summary"]["domains"].items() if s.get("unscored_tasks") and not s["tasks"]]
                for role, ev in evaluations.items()}
    result = {"out": str(folder), "text": text, "skipped": dict(skipped),
              "task_set_hash": evaluations["candidate"]["task_set_hash"],
              "unscored": {role: ds for role, ds in unscored.items() if ds}}
    if (folder / "comparison.json").is_file():
        result["counts"] = json.loads((folder / "comparison.json").read_text())["counts"]
    return result


def rescore_folder(folder: str, *, suite_path: str | None = None, out: str | None = None) -> dict:
    """Rescores a report folder (baseline/ and candidate/) or one evaluation folder without sampling.

    With the scorers and formats of `suite_path` (else those recorded); writes to `out` (default <folder>/rescored)."""
    folder = pathlib.Path(folder)
    roles = [r for r in ("baseline", "candidate") if (folder / r).is_dir()] or [None]
    overrides = ({d.name: d for d in suite_lib.load_suite(suite_path).domains} if suite_path else {})
    evaluations, described, alpha = {}, {}, 0.05
    for role in roles:
        records, results = records_lib.read_evaluation(folder / role if role else folder)
        described, alpha = results["suite"], results["suite"].get("alpha", alpha)
        specs = {row["name"]: {**row, **({"scorer": overrides[row["name"]].scorer,
                                          "format": overrides[row["name"]].format} if row["name"] in overrides else {})}
                 for row in described["domains"]}
        t0 = time.perf_counter()
        rescored = records_lib.rescore(records, specs)
        ks = {name: tuple(row.get("ks", ())) for name, row in specs.items()}
        evaluations[role or "candidate"] = _evaluation(results["label"], rescored,
                                                       {"total": time.perf_counter() - t0}, results.get("step"), ks,
                                                       described)
    target = pathlib.Path(out) if out else folder / "rescored"
    target.mkdir(parents=True, exist_ok=True)
    text = write_report(target, evaluations, alpha, described.get("skipped", {}))
    return _result(target, text, evaluations, described.get("skipped", {}))


def offline_plan(workdir, kind: str):
    """The plan of the offline run in `workdir` from its saved config.json; ConfigError naming the file if it fails."""
    from posttrain.config import dpo, rm, sft
    from posttrain.recipes import dpo as dpo_recipe, rm as rm_recipe, sft as sft_recipe

    load, make = {"sft": (sft.sft_config_from_dict, sft_recipe.make_sft_plan),
                  "dpo": (dpo.dpo_config_from_dict, dpo_recipe.make_dpo_plan),
                  "rm": (rm.rm_config_from_dict, rm_recipe.make_rm_plan)}[kind]
    path = pathlib.Path(workdir) / "config.json"
    try:
        cfg = load(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {' '.join(str(e).split())}") from None
    return make(cfg, workdir=str(workdir))


# a suite evaluation's stand-in for the env section of an SFT / DPO run that has none: never built (the suite's envs
# are all a suite evaluation builds, `grpo.build(held_out=False)`) nor written anywhere
SUITE_PLACEHOLDER_ENV = {"id": "posttrain/Arithmetic-v0"}


def policy_eval_config(workdir, kind: str, cfg: Config | None, suite: bool = False) -> Config:
    """The GRPO Config that evaluates the policy of the SFT / DPO run in `workdir`.

    Its sections are `cfg`'s, else those of the GRPO run it was trained from, else (a `suite` evaluation, which
    builds no env of the run) the defaults with SUITE_PLACEHOLDER_ENV; then the run's OFFLINE_STATE_SECTIONS, its
    workdir and a learner shaped like the run's (no reference copy, one update per step). Raises ConfigError when
    none gives an env."""
    from posttrain.config.load import saved_config

    saved = json.loads((pathlib.Path(workdir) / "config.json").read_text())
    source = saved.get(kind, {}).get("from_archive") or ""
    base = cfg
    if base is None and source and run_kind(source) == "grpo":
        base = saved_config(source)
    if base is None and suite:
        from posttrain.config import EnvSpec

        base = dataclasses.replace(Config(), env=dataclasses.replace(
            Config().env, train={"suite_placeholder": EnvSpec(**SUITE_PLACEHOLDER_ENV)}))
    if base is None:
        raise refuse(workdir, kind, "eval", "needs an env to evaluate on: pass --config=configs/X.py (its env and "
                     "eval sections; the run's model and weights are used), or --suite" +
                     (f" (its from_archive run {source!r} has no GRPO config.json)" if source else ""))
    from posttrain.config import from_config_dict, to_dict

    own = offline_plan(workdir, kind).config_dict  # validated; the sections as the run saved them

    raw = to_dict(base)
    raw.update({s: own[s] for s in OFFLINE_STATE_SECTIONS})
    raw["rl"].update(beta=0.0, ppo_epochs=1, minibatches=1)  # the offline learner's state: no reference copy
    raw["train"]["workdir"] = str(workdir)
    return from_config_dict(raw)


def reading_config(workdir, cfg: Config | None = None, command: str = "eval", suite: bool = False) -> Config:
    """The GRPO Config with which `command` evaluates the policy of the run in `workdir` (docs/runs.md).

    A GRPO run's `config_for_run`, an SFT / DPO run's `policy_eval_config`. Raises ConfigError for a reward-model run
    (it has no policy) or a run without a usable config."""
    from posttrain.config.load import config_for_run

    kind = run_kind(workdir)
    if kind == "rm":
        raise refuse(workdir, kind, command, "evaluates a policy; a reward model scores replies (use it as "
                     f"rewards.model={workdir} in a GRPO config)")
    if kind in OFFLINE_KINDS:
        return policy_eval_config(workdir, kind, cfg, suite)
    return config_for_run(workdir, cfg)


def offline_model(workdir, kind: str):
    """(ModelConfig, nnx state, tokenizer) of an offline run's newest checkpoint, read only (LoRA unmerged)."""
    from flax import nnx

    from posttrain.checkpoints.policy import load_policy
    from posttrain.infra import mesh as mesh_lib
    from posttrain.infra.partitioning import use_rules
    from posttrain.learn.learner import Learner
    from posttrain.learn.state import merge_model

    require_checkpoint(workdir)
    plan = offline_plan(workdir, kind)
    with use_rules(plan.rules):
        mesh = mesh_lib.make_mesh(plan.mesh_shape)
        model_config, graphdef, weights, tokenizer = load_policy(plan.policy, mesh, plan.rules)
        kw = {}
        if kind == "rm":
            from posttrain.algos.rm.step import RewardBatch
            from posttrain.model.reward_head import with_head

            graphdef, weights = with_head(model_config, graphdef, weights, mesh, plan.rules, seed=plan.learner.seed)
            kw["batch_type"] = RewardBatch
        never_run = lambda *a: (lambda state, batch: (state, {}))  # noqa: E731 (reading: no step is taken)
        learner = Learner.create(plan.learner, mesh, model_config, graphdef, weights, never_run, read_only=True, **kw)
        try:
            learner.restore()
            s = learner.state
            return model_config, nnx.state(merge_model(learner.graphdef, s.params, s.frozen)), tokenizer
        finally:
            learner.close()
