"""`posttrain train|sft|dpo|eval|sample|convert|domains|plan`: the recipes' command line (absl flags, ml-collections).

  posttrain train  --config=configs/quickstart.py [--config.rl.group_size=8 ...] [--workdir=DIR]   (GRPO)
  posttrain sft    --config=configs/sft_tiny.py [--workdir=DIR]   (supervised fine-tuning on chat data)
  posttrain dpo    --config=configs/dpo_tiny.py [--workdir=DIR]   (direct preference optimisation on pairs)
  posttrain eval   --config=configs/quickstart.py --checkpoint=DIR   (DIR: a run's workdir)
  posttrain eval   --suite=configs/eval/default.py --checkpoint=DIR [--baseline=base|RUN2] [--limit=N]
                   [--domains=PATTERNS] [--out=DIR]   (a suite, paired verdicts vs the baseline; recipes/evaluate.py)
  posttrain eval   --from_records=DIR [--suite=...]   (rescore a suite report's recorded replies, no sampling)
  posttrain sample --prompt="What is 12 + 30?" [--model=PATH.gguf|HF_DIR | --checkpoint=DIR] [--max_new_tokens=64]
                   [--temperature=0.7] [--seed=0]   (--checkpoint: a run's latest policy, its saved config.json)
  posttrain convert --model=PATH.gguf|HF_DIR --out=HF_DIR [--dtype=bfloat16] [--max_shard_mb=4096]
  posttrain convert --config=configs/X.py --checkpoint=DIR --out=HF_DIR  (a run's latest policy, LoRA merged)
                    [--peft_out=DIR]  (LoRA runs: also the unmerged adapter in PEFT format)
  posttrain domains [--pattern='*']  (registered domains: golden-check status + a sample task)
  posttrain plan --config=configs/plan/kimi_k2.py --target=v5p-512|h200x256|cpu-8 [--json] [--prompt_len=512] [--nosampler]
                 (compile the train step for that machine without it: fits? per-device memory, FLOPs)
Multi-host: start one process per host with --distributed (launch/ has TPU-pod and SLURM scripts).
"""
from __future__ import annotations

import json
import os
import sys

COMMANDS = ("train", "eval", "sample", "convert", "domains", "plan", "sft", "dpo")


def _flags():
    from absl import flags
    from ml_collections import config_flags

    f = flags.FLAGS
    if f.is_parsed():  # an earlier main() in this process: its values and --config.* override flags go
        f.unparse_flags()
    for name in [n for n in f if n.startswith("config.")]:
        delattr(f, name)
    if "workdir" not in f:
        config_flags.DEFINE_config_file("config", None, "a configs/*.py file defining get_config()")
        flags.DEFINE_string("workdir", None, "output directory (default: config.train.workdir)")
        flags.DEFINE_string("checkpoint", None, "eval/convert/sample: the workdir of a run whose latest checkpoint "
                            "to use (read only)")
        flags.DEFINE_string("prompt", "What is 12 + 30?", "sample: the user message")
        flags.DEFINE_string("model", None, "sample/convert: a .gguf file or HF directory (default: SmolLM2 GGUF)")
        flags.DEFINE_string("out", None, "convert: output directory (a complete HF model directory); eval --suite: "
                            "the report folder (default <checkpoint>/eval/<suite name>)")
        flags.DEFINE_string("suite", None, "eval: a configs/eval/*.py suite (domains by capability area)")
        flags.DEFINE_string("baseline", None, "eval --suite: 'base' (the run's initial policy) or a run's workdir")
        flags.DEFINE_integer("limit", None, "eval --suite: at most this many tasks per domain")
        flags.DEFINE_string("domains", None, "eval --suite: only these domains (names or patterns, comma-separated)")
        flags.DEFINE_string("from_records", None, "eval: rescore the records of a suite report folder (no sampling)")
        flags.DEFINE_string("dtype", None, "convert: float32|bfloat16|float16 of the written weights "
                            "(default: the model's parameter dtype)")
        flags.DEFINE_integer("max_shard_mb", 4096, "convert: safetensors shard size limit in MiB")
        flags.DEFINE_string("peft_out", None, "convert --checkpoint of a LoRA run: also write the adapter "
                            "(adapter_config.json + adapter_model.safetensors) here")
        flags.DEFINE_integer("max_new_tokens", 64, "sample: tokens to generate")
        flags.DEFINE_string("pattern", "*", "domains: domain names or patterns, comma-separated")
        flags.DEFINE_float("temperature", 0.0, "sample: 0 = greedy")
        flags.DEFINE_integer("seed", 0, "sample: the sampling stream (temperature > 0: another seed, another reply)")
        flags.DEFINE_bool("progress", True, "train: show a progress bar")
        flags.DEFINE_bool("allow_config_change", False, "train: resume a run with settings other than its saved "
                          "config.json (each change recorded with its step in config_changes.jsonl)")
        flags.DEFINE_string("target", "cpu-8", "plan: cpu-N | v5p-N (TensorCores) | h200xN")
        flags.DEFINE_bool("json", False, "plan: print one JSON line")
        flags.DEFINE_integer("prompt_len", 512, "plan: prompt tokens per sequence (completions: sampling.max_new_tokens)")
        flags.DEFINE_bool("sampler", True, "plan: also compile the rollout sampler (prefill + decode loop)")
        flags.DEFINE_bool("distributed", False, "multi-host: call jax.distributed.initialize() first "
                          "(also on with POSTTRAIN_DISTRIBUTED=1; see launch/)")
    return f


def _load_config(f):
    from posttrain.config import from_config_dict

    if f.config is None:
        raise SystemExit("error: --config=configs/<name>.py is required (train: or --workdir=DIR of a run, to "
                         "resume it with its saved settings)")
    return from_config_dict(f.config)


def _enable_compilation_cache():
    import jax

    path = os.environ.get("POSTTRAIN_XLA_CACHE", os.path.expanduser("~/.cache/posttrain/xla"))
    if path and path != "0":
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)


def _sample_policy(f):
    """(graphdef, state, tokenizer) for `sample`: the newest readable checkpoint of the run in --checkpoint (read
    only, its saved config.json; `grpo.run_policy`), else --model (default: the SmolLM2 GGUF)."""
    if f.checkpoint:
        from flax import nnx

        from posttrain.model.transformer import Transformer
        from posttrain.recipes import grpo

        if f.model:
            raise SystemExit("error: sample takes one of --model=PATH and --checkpoint=RUN, not both")
        cfg, state, tok = grpo.run_policy(_run_plan(f))
        return nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))), state, tok
    from posttrain.checkpoints import load_pretrained

    pre = load_pretrained(f.model)
    return pre.graphdef, pre.state, pre.tokenizer


def cmd_sample(f) -> int:
    import jax

    from posttrain.rollout.sampler import SamplingParams, pad_prompts, sample

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
    from posttrain.recipes import grpo as loop
    from posttrain.recipes.run_plan import make_run_plan

    if f.config is None and f.workdir:  # resuming a run by its directory: the settings it saved
        from posttrain.recipes.run_plan import config_for_run

        cfg = config_for_run(f.workdir)
    else:
        cfg = _load_config(f)
    plan = make_run_plan(cfg, workdir=f.workdir)  # every setting validated before any work
    summary = loop.train(plan, progress=f.progress, allow_config_change=f.allow_config_change)
    keys = ("start_step", "end_step", "train_wall_s", "peak_rss_gb", "env_episodes")
    out = {k: summary.get(k) for k in keys}
    for which in ("eval_start", "eval_end"):
        if which in summary:
            out[which] = summary[which].get("eval/pass@1")
    print(json.dumps(out))
    return 0


def _run_plan(f):
    """The run plan for the run in --checkpoint (its workdir): its saved config.json, or --config with the run's
    own model and lora sections (`run_plan.config_for_run`)."""
    import dataclasses

    from posttrain.recipes.grpo import require_checkpoint
    from posttrain.recipes.run_plan import config_for_run, make_run_plan

    if not f.checkpoint:
        raise SystemExit("error: --checkpoint=<run workdir> is required")
    require_checkpoint(f.checkpoint)  # a mistyped directory: one line, nothing created
    cfg = config_for_run(f.checkpoint, _load_config(f) if f.config is not None else None)
    return make_run_plan(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, workdir=f.checkpoint)))


def cmd_sft(f) -> int:
    """`posttrain sft --config=configs/sft_*.py [--workdir=DIR]`: supervised fine-tuning (`recipes.sft`); prints
    the summary's steps and held-out perplexities as one JSON line."""
    from posttrain.config.sft import sft_config_from_dict
    from posttrain.recipes import sft

    return _offline(f, sft_config_from_dict, sft.make_sft_plan, sft.train, "sft/ppl")


def cmd_dpo(f) -> int:
    """`posttrain dpo --config=configs/dpo_*.py [--workdir=DIR]`: direct preference optimisation (`recipes.dpo`);
    prints the summary's steps and held-out pair accuracies as one JSON line."""
    from posttrain.config.dpo import dpo_config_from_dict
    from posttrain.recipes import dpo

    return _offline(f, dpo_config_from_dict, dpo.make_dpo_plan, dpo.train, "dpo/eval_accuracy")


def _offline(f, load, make_plan, train, eval_key: str) -> int:
    """An offline recipe's command: config -> plan -> train; prints steps, wall time, peak RSS and the held-out
    `eval_key` at the start and the end as one JSON line."""
    if f.config is None:
        raise SystemExit("error: --config=configs/<name>.py is required")
    summary = train(make_plan(load(f.config), workdir=f.workdir), progress=f.progress)
    out = {k: summary.get(k) for k in ("start_step", "end_step", "train_wall_s", "peak_rss_gb")}
    out.update({k: summary[k].get(eval_key) for k in ("eval_start", "eval_end") if k in summary})
    print(json.dumps(out))
    return 0


def cmd_eval(f) -> int:
    if f.suite or f.from_records:
        from posttrain.config import ConfigError
        from posttrain.recipes import evaluate

        if not (f.from_records or f.checkpoint):
            raise SystemExit("error: --checkpoint=<run workdir> is required")
        try:
            result = (evaluate.rescore_folder(f.from_records, suite_path=f.suite, out=f.out) if f.from_records else
                      evaluate.evaluate_suite(f.suite, f.checkpoint, baseline=f.baseline, limit=f.limit,
                                              domains=f.domains, out=f.out,
                                              cfg=_load_config(f) if f.config is not None else None))
        except (ConfigError, evaluate.grpo.RunNotFoundError):
            raise  # main() prints them in one line with exit code 2
        except (ValueError, FileNotFoundError) as e:  # a bad suite, selection or records folder
            raise SystemExit(f"error: {' '.join(str(e).split())}") from None
        print(result.pop("text"))
        print(json.dumps(result))
        return 0
    from posttrain.recipes import grpo

    step, m = grpo.evaluate_run(_run_plan(f))
    print(json.dumps({"step": step, **m}))
    return 0


def cmd_convert(f) -> int:
    from posttrain.checkpoints import load_pretrained
    from posttrain.checkpoints.export import export_hf

    if not f.out:
        raise SystemExit("error: --out=<directory> is required")
    if f.checkpoint:
        from posttrain.recipes import grpo

        cfg, state, tokenizer = grpo.run_policy(_run_plan(f))
    else:
        pre = load_pretrained(f.model)
        cfg, state, tokenizer = pre.config, pre.state, pre.tokenizer
    if f.peft_out:
        from posttrain.checkpoints.peft import export_peft

        if not (cfg.lora and cfg.lora.rank):
            raise SystemExit("error: --peft_out needs a LoRA run (--checkpoint of a run with lora.rank > 0)")
        print(export_peft(cfg, state, f.peft_out, dtype=f.dtype))
    print(export_hf(cfg, state, f.out, tokenizer=tokenizer, dtype=f.dtype, max_shard_bytes=f.max_shard_mb << 20))
    return 0


def cmd_domains(f) -> int:
    """Prints every registered domain matching --pattern with its golden-check status (`envs.tasks.domains`)."""
    from envs.tasks import domains
    try:
        checks = domains.summary(f.pattern)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(domains.format_listing(checks))
    return 0


def cmd_plan(f) -> int:
    """Compiles the config's train step for --target and prints the per-device report; exit 1 when it does not fit."""
    from posttrain.recipes.dryrun import plan_train_step

    cfg = _load_config(f)
    from posttrain.config import ConfigError

    try:
        report = plan_train_step(cfg, f.target, prompt_len=f.prompt_len, sampler=f.sampler)
    except ConfigError:
        raise  # main() prints it in one line with exit code 2
    except (ValueError, RuntimeError, AssertionError) as e:  # AssertionError: assert_sufficiently_sharded
        raise SystemExit(f"error: {' '.join(str(e).split())}") from None
    if f.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k:>20}: {round(v, 3) if isinstance(v, float) else v}")
    if not report["fits"]:
        from posttrain.recipes.dryrun import fit_verdict

        print(f"error: {fit_verdict(report, f.target)}", file=sys.stderr)
        return 1
    return 0


def _fake_cpu_devices_for_plan(argv) -> None:
    """`plan --target=cpu-N` needs N CPU devices: ask XLA before JAX starts (unless XLA_FLAGS has it); nothing is
    set once JAX is imported (`main` called in a running program: the flag could only reach its subprocesses)."""
    if "jax" in sys.modules:
        return
    target = next((a.split("=", 1)[1] for a in argv if a.startswith("--target=")), "cpu-8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # TPU/GPU targets compile through their plugins' topologies
    if target.startswith("cpu-") and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={target[4:]}").strip()


def main(argv=None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    command = argv.pop(1)
    if command == "plan":
        _fake_cpu_devices_for_plan(argv)
    f = _flags()
    if any(a in ("--help", "-h", "--helpshort", "--helpfull", "-help") for a in argv[1:]):
        print(command_help(command, f))
        return 0
    try:
        f(argv)
    except Exception as e:  # absl raises its own error types for unknown/invalid flags
        print(f"error: {flag_error_line(e, argv)}", file=sys.stderr)
        return 2
    from posttrain.config import ConfigError
    from posttrain.infra import distributed
    from posttrain.checkpoints.orbax import CheckpointCorruptError
    from posttrain.recipes.grpo import RunNotFoundError
    from posttrain.rollout.rollouter import EnvInfraError

    distributed.initialize(True if f.distributed else None)
    if command != "plan":  # a plan measures a real compile (time, buffer report): no persistent cache
        _enable_compilation_cache()
    try:
        return {"train": cmd_train, "eval": cmd_eval, "sample": cmd_sample, "convert": cmd_convert,
                "domains": cmd_domains, "plan": cmd_plan, "sft": cmd_sft,
                "dpo": cmd_dpo}[command](f)
    except ConfigError as e:  # raised before any model load or worker start: one line, no traceback
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except RunNotFoundError as e:  # a command that reads a run found none: nothing created, no base model
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CheckpointCorruptError as e:  # every checkpoint of the run unreadable: never the base model instead
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except EnvInfraError as e:  # the envs, not the policy, failed a step: the first worker error, one line
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except distributed.RunInterrupted as e:  # SIGINT / SIGTERM: the state was saved; 128 + the signal's number
        import signal

        print(f"interrupted: {e}", file=sys.stderr)
        return 128 + int(getattr(signal, e.signal_name, signal.SIGINT))


# flags every command that takes them reads (the others are named by their help's "command:" prefixes)
_SHARED_FLAGS = {"config": ("train", "sft", "dpo", "eval", "convert", "plan"), "workdir": ("train", "sft", "dpo"),
                 "distributed": COMMANDS}


def command_help(command: str, f) -> str:
    """`posttrain <command> --help`: the command's usage lines (from this module's docstring) and its flags with
    their defaults and help; a flag belongs to a command its help names before a colon ("eval/convert: ...")."""
    import re

    lines = __doc__.splitlines()
    usage, inside = [], False
    for line in lines:
        if line.startswith(f"  posttrain {command} ") or line == f"  posttrain {command}":
            inside = True
        elif not line.startswith("    ") or line.startswith("  posttrain "):
            inside = False
        if inside:
            usage.append(line)
    out = [f"usage: posttrain {command} [flags]", *usage, "", "flags:"]
    for name, flag in sorted(f._flags().items()):
        if name != flag.name or name.startswith("config."):
            continue
        owners = re.findall(r"(?:^|[;,] *)([a-z/]+)(?: --\w+)?:", flag.help or "")
        commands = {c for owner in owners for c in owner.split("/")}
        if command in _SHARED_FLAGS.get(name, ()) or command in commands:
            out.append(f"  --{name}={flag.default!r}: {' '.join((flag.help or '').split())}")
    if command in _SHARED_FLAGS["config"]:
        import dataclasses

        from posttrain.config import Config

        sections = [field.name for field in dataclasses.fields(Config)]
        out.append(f"  --config.<section>.<key>=VALUE: override any key of the --config file; sections: {sections} "
                   "(keys: the config file, posttrain/config/schema.py)")
    return "\n".join(out)


def flag_error_line(e: BaseException, argv) -> str:
    """One line for a command-line error; an unknown --config.* key names the key and ml_collections' suggestion
    (which arrives as the repr of a KeyError inside absl's error), or without one the keys that exist there."""
    chain, c = [], e
    while c is not None and all(c is not x for x in chain):
        chain.append(c)
        c = c.__cause__ or c.__context__
    for c in chain:
        if isinstance(c, KeyError) and c.args and isinstance(c.args[0], str):
            key, _, hint = c.args[0].partition("\n")
            key = key.strip("'\"")
            flag = next((a.split("=")[0] for a in argv if a.startswith("--config.")
                         and key in a.split("=")[0].split(".")), key)
            if not hint.strip():  # no close match: name the keys that exist there
                from posttrain.config.load import unknown_key_message

                value = next((a.split("=", 1)[1] for a in argv if a.startswith(f"{flag}=")), "...")
                return unknown_key_message(flag.removeprefix("--"), key, value)
            return f"unknown config key {flag.removeprefix('--')}: {hint.strip()}"
    return " ".join(str(e).split())


if __name__ == "__main__":
    sys.exit(main())
