"""The commands of `posttrain`, each `cmd_<name>(flags) -> exit code`: flags -> a recipe.

Each command imports its recipe when it runs, so the usage line and `posttrain status` load no JAX.

  posttrain rm     --config=configs/rm_tiny.py [--workdir=DIR]   (a scalar head on the config's model)
  posttrain rm     --from_archive=RUN[,RUN] [--config=...] [--workdir=DIR]   (pairs from a GRPO run's groups: 1 over 0)
                   (prints the steps and the held-out rm/accuracy at the start and the end as one JSON line; the
                   model is exported to DIR/reward_model, what a GRPO run's rewards.model=DIR loads)"""
from __future__ import annotations

import fnmatch
import json
import os
import pathlib
import sys


class UsageError(Exception):
    """A command-line mistake (a missing or conflicting flag, a bad value or path): one line, exit code 2."""


def check_run_flags(f, command: str) -> None:
    """Raises UsageError, naming the run, for a run's flag (--checkpoint, --baseline, ...) set to a folder in a run."""
    named = [("--checkpoint", f.checkpoint), ("--baseline", f.baseline if f.baseline != "base" else None),
             *[("--from_archive", run) for run in (f.from_archive or "").split(",")],
             ("--workdir", f.workdir if command == "status" else None)]
    for flag, path in named:
        if not (path and path.strip()):
            continue
        p = pathlib.Path(path.strip())
        folder = p if p.name == "checkpoints" else p.parent if p.parent.name == "checkpoints" else None
        if (folder is not None and folder.is_dir() and not (p / "checkpoints").is_dir()
                and (folder.parent / "config.json").is_file()):
            what = "the checkpoints/ folder" if folder == p else "a checkpoint step folder"
            raise UsageError(f"{flag}={path.strip()} is {what} of the run {folder.parent}; {flag} names the run's own "
                             f"folder (the one holding config.json): {flag}={folder.parent}")


def _load_config(f):
    from posttrain.config import from_config_dict

    if f.config is None:
        raise UsageError("--config=configs/<name>.py is required (train: or --workdir=DIR of a run, to "
                         "resume it with its saved settings)")
    return from_config_dict(f.config)


def _enable_compilation_cache():
    import jax

    path = os.environ.get("POSTTRAIN_XLA_CACHE", os.path.expanduser("~/.cache/posttrain/xla"))
    if path and path != "0":
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)


def _sample_policy(f):
    """(graphdef, state, tokenizer) for `sample`: --checkpoint's run (`_run_model`), else --model (default: SmolLM2)."""
    if f.checkpoint:
        from flax import nnx

        from posttrain.model.transformer import Transformer

        if f.model:
            raise UsageError("sample takes one of --model=PATH and --checkpoint=RUN, not both")
        kind, cfg, state, tok = _run_model(f, "sample")
        return nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))), state, tok
    pre = _pretrained(f.model)
    return pre.graphdef, pre.state, pre.tokenizer


def _pretrained(model):
    """`load_pretrained(model)`; UsageError naming --model for a file it cannot read as a model."""
    from posttrain.checkpoints import load_pretrained

    try:
        return load_pretrained(model)
    except ValueError as e:
        raise UsageError(f"--model={model}: {' '.join(str(e).split())}") from None


def cmd_sample(f) -> int:
    import jax

    from posttrain.generate.sampler import SamplingParams, pad_prompts, sample

    graphdef, state, tok = _sample_policy(f)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": f.prompt}], add_generation_prompt=True))
    prompts, lengths = pad_prompts([ids], tok.pad_id)
    out = sample(graphdef, state, prompts, lengths, jax.random.key(f.seed), group_size=1,
                 params=SamplingParams(max_new_tokens=f.max_new_tokens, temperature=f.temperature),
                 stop_ids=tuple(tok.stop_ids), pad_id=tok.pad_id)
    n = int(out.lengths_N[0])
    print(tok.decode(list(map(int, out.tokens_NxLg[0, :n]))))
    return 0


def cmd_train(f) -> int:
    from posttrain.recipes import grpo as grpo_lib
    from posttrain.config.plan import make_run_plan

    if f.config is None and f.workdir:  # resuming a run by its directory: the settings it saved
        from posttrain.config.load import config_for_run

        cfg = config_for_run(f.workdir)
    else:
        cfg = _load_config(f)
    plan = make_run_plan(cfg, workdir=f.workdir)  # every setting validated before any work
    summary = grpo_lib.train(plan, progress=f.progress, allow_config_change=f.allow_config_change)
    keys = ("start_step", "end_step", "train_wall_s", "peak_rss_gb", "env_episodes")
    out = {k: summary.get(k) for k in keys}
    for which in ("eval_start", "eval_end"):
        if which in summary:
            out[which] = summary[which].get("eval/pass@1")
    out["eval_metric"] = "eval/pass@1"  # what eval_start / eval_end hold
    print(json.dumps(out))
    return 0


def _run_plan(f):
    """The GRPO run plan that evaluates the policy of the run in --checkpoint, of any kind (`reading_config`)."""
    import dataclasses

    from posttrain.recipes.evaluate import reading_config
    from posttrain.runs.lookup import require_checkpoint
    from posttrain.config.plan import make_run_plan

    if not f.checkpoint:
        raise UsageError("--checkpoint=<run workdir> is required")
    require_checkpoint(f.checkpoint)  # a mistyped directory: one line, nothing created
    cfg = reading_config(f.checkpoint, _load_config(f) if f.config is not None else None)
    return make_run_plan(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, workdir=f.checkpoint)))


def _run_model(f, command: str):
    """(kind, ModelConfig, nnx state, tokenizer) of the run in --checkpoint's newest checkpoint, read only.

    A GRPO run's `grpo.run_policy`, an offline run's `evaluate.offline_model`; `sample` refuses a reward model."""
    from posttrain.recipes import evaluate, grpo
    from posttrain.runs import read
    from posttrain.runs.lookup import require_checkpoint

    if not f.checkpoint:
        raise UsageError("--checkpoint=<run workdir> is required")
    require_checkpoint(f.checkpoint)
    kind = read.run_kind(f.checkpoint)
    if kind == "rm" and command == "sample":
        raise read.refuse(f.checkpoint, kind, command, "generates replies; a reward model only scores them")
    if kind in read.OFFLINE_KINDS:
        return (kind, *evaluate.offline_model(f.checkpoint, kind))
    return ("grpo", *grpo.run_policy(_run_plan(f)))


def cmd_rm(f) -> int:
    """`posttrain rm`: reward-model training; prints the steps and held-out rm/accuracy as one JSON line."""
    from posttrain.config.rm import default_rm_config, rm_config_from_dict
    from posttrain.recipes import rm

    return _offline(f, "rm", default_rm_config, rm_config_from_dict, rm.make_rm_plan, rm.train, "rm/accuracy")


def cmd_sft(f) -> int:
    """`posttrain sft`: supervised fine-tuning; prints the steps and held-out perplexities as one JSON line."""
    from posttrain.config.sft import default_sft_config, sft_config_from_dict
    from posttrain.recipes import sft

    return _offline(f, "sft", default_sft_config, sft_config_from_dict, sft.make_sft_plan, sft.train, "sft/ppl")


def cmd_dpo(f) -> int:
    """`posttrain dpo`: preference optimisation; prints the steps and held-out pair accuracies as one JSON line."""
    from posttrain.config.dpo import default_dpo_config, dpo_config_from_dict
    from posttrain.recipes import dpo

    return _offline(f, "dpo", default_dpo_config, dpo_config_from_dict, dpo.make_dpo_plan, dpo.train,
                    "dpo/eval_accuracy")


def _offline_config(f, name: str, default) -> dict:
    """The offline config dict: --config's, or the defaults with the --from_archive runs' `model`, flags applied."""
    if f.config is None and not f.from_archive:
        raise UsageError("--config=configs/<name>.py or --from_archive=<GRPO run workdir> is required")
    raw = (f.config if f.config is not None else default()).to_dict()
    if f.from_archive:
        if f.config is None:
            raw["model"] = _archive_model(f.from_archive, raw["model"])
        raw[name]["from_archive"] = f.from_archive
    for key in ("min_reward", "max_per_prompt"):
        if getattr(f, key) is not None:
            if name != "sft" or not f.from_archive:
                raise UsageError(f"--{key} applies to sft --from_archive only")
            raw[name][key] = getattr(f, key)
    return raw


def _archive_model(runs: str, default: dict) -> dict:
    """The `model` section of the --from_archive runs (`default` without config.json); UsageError when theirs differ."""
    from posttrain.algos.from_archive import archive_runs

    models = {}
    for run in archive_runs(runs):
        saved = os.path.join(run, "config.json")
        if os.path.isfile(saved):
            with open(saved, encoding="utf-8") as fh:
                models[run] = json.load(fh).get("model", default)
    distinct = {json.dumps(m, sort_keys=True): r for r, m in models.items()}
    if len(distinct) > 1:
        raise UsageError(f"--from_archive={runs}: the runs {sorted(distinct.values())} have different "
                         "`model` sections (their archives' token ids belong to different models)")
    return next(iter(models.values()), default)


def _offline(f, name: str, default, load, make_plan, train, eval_key: str) -> int:
    """An offline recipe's command: config -> plan -> train; prints steps and held-out `eval_key` as one JSON line."""
    summary = train(make_plan(load(_offline_config(f, name, default)), workdir=f.workdir), progress=f.progress)
    out = {k: summary.get(k) for k in ("start_step", "end_step", "train_wall_s", "peak_rss_gb")}
    out.update({k: summary[k].get(eval_key) for k in ("eval_start", "eval_end") if k in summary})
    out["eval_metric"] = eval_key  # what eval_start / eval_end hold (perplexity, pair accuracy)
    print(json.dumps(out))
    return 0


def cmd_eval(f) -> int:
    if f.suite or f.from_records:
        from posttrain.config import ConfigError
        from posttrain.recipes import evaluate
        from posttrain.runs.lookup import RunNotFoundError

        if not (f.from_records or f.checkpoint):
            raise UsageError("--checkpoint=<run workdir> is required")
        try:
            result = (evaluate.rescore_folder(f.from_records, suite_path=f.suite, out=f.out) if f.from_records else
                      evaluate.evaluate_suite(f.suite, f.checkpoint, baseline=f.baseline, limit=f.limit,
                                              domains=f.domains, out=f.out,
                                              cfg=_load_config(f) if f.config is not None else None))
        except (ConfigError, RunNotFoundError):
            raise  # main() prints them in one line with exit code 2
        except (ValueError, FileNotFoundError) as e:  # a bad suite, selection or records folder
            raise UsageError(f"{' '.join(str(e).split())}") from None
        print(result.pop("text"))
        print(json.dumps(result))
        if result["unscored"]:  # the report is written, but a domain of it could not be evaluated at all
            listed = "; ".join(f"{role}: {', '.join(ds)}" for role, ds in result["unscored"].items())
            print(f"error: no task of these domains was scored, every sample ended in infra_error (the env or its "
                  f"sandbox failed; the records' reasons say why): {listed}", file=sys.stderr)
            return 1
        return 0
    from posttrain.recipes import grpo

    step, m = grpo.evaluate_run(_run_plan(f))
    print(json.dumps({"step": step, **m}))
    return 0


def cmd_convert(f) -> int:
    from posttrain.checkpoints.export import export_hf

    from posttrain.runs.workdir import check_export_dir

    if not f.out:
        raise UsageError("--out=<directory> is required")
    check_export_dir(f.out, source=f.checkpoint)  # never into a run (its config.json), before any load
    if f.peft_out:
        check_export_dir(f.peft_out, source=f.checkpoint)
    kind = "model"
    if f.checkpoint:
        kind, cfg, state, tokenizer = _run_model(f, "convert")
    else:
        pre = _pretrained(f.model)
        cfg, state, tokenizer = pre.config, pre.state, pre.tokenizer
    if kind == "rm":  # a reward model: a transformers sequence-classification directory (what `posttrain rm` exports)
        from posttrain.checkpoints.reward_model import export_reward_model

        if f.peft_out:
            raise UsageError("--peft_out needs a LoRA policy run; a reward-model run exports its full model")
        print(export_reward_model(cfg, state, f.out, tokenizer=tokenizer, dtype=f.dtype))
        return 0
    if f.peft_out:
        from posttrain.checkpoints.peft import export_peft

        if not (cfg.lora and cfg.lora.rank):
            raise UsageError("--peft_out needs a LoRA run (--checkpoint of a run with lora.rank > 0)")
        print(export_peft(cfg, state, f.peft_out, dtype=f.dtype))
    print(export_hf(cfg, state, f.out, tokenizer=tokenizer, dtype=f.dtype, max_shard_bytes=f.max_shard_mb << 20))
    return 0


def cmd_domains(f) -> int:
    """Prints the registered domains matching --pattern with their golden checks; --floors: floors, --write: stored."""
    from envs.tasks import domains, floors
    try:
        if f.floors:
            names = [d for d in domains.registered_domains()
                     if any(fnmatch.fnmatchcase(d, p.strip()) for p in f.pattern.split(",") if p.strip())]
            if not names:
                raise ValueError(f"--pattern={f.pattern!r} matches no domain")
            rows = floors.assess_all(names, progress=lambda a: print(f"{a.domain}: floor {a.floor} ({a.probe}), "
                                                                     f"golden {a.golden}", file=sys.stderr))
            print(floors.format_floors(rows))
            if f.write:
                print(f"wrote {floors.write_table(rows)}")
            return 0
        checks = domains.summary(f.pattern)
    except ValueError as e:
        raise UsageError(f"{e}") from None
    print(domains.format_listing(checks))
    return 0


def cmd_plan(f) -> int:
    """Compiles the config's train step for --target and prints the per-device report; exit 1 when it does not fit."""
    from posttrain.recipes.plan import plan_train_step

    cfg = _load_config(f)
    from posttrain.config import ConfigError

    try:
        report = plan_train_step(cfg, f.target, prompt_len=f.prompt_len, sampler=f.sampler)
    except ConfigError:
        raise  # main() prints it in one line with exit code 2
    except (ValueError, RuntimeError, AssertionError) as e:  # AssertionError: assert_sufficiently_sharded
        raise UsageError(f"{' '.join(str(e).split())}") from None
    if f.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k:>20}: {round(v, 3) if isinstance(v, float) else v}")
    if not report["fits"]:
        from posttrain.recipes.plan import fit_verdict

        print(f"error: {fit_verdict(report, f.target)}", file=sys.stderr)
        return 1
    return 0


def _fake_cpu_devices_for_plan(argv) -> None:
    """Asks XLA for the CPU devices `plan --target=cpu-N` needs, before JAX is imported (after, it does nothing)."""
    if "jax" in sys.modules:
        return
    target = next((a.split("=", 1)[1] for a in argv if a.startswith("--target=")), "cpu-8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # TPU/GPU targets compile through their plugins' topologies
    if target.startswith("cpu-") and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={target[4:]}").strip()
