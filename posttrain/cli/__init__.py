"""`posttrain train|sft|dpo|rm|eval|sample|convert|domains|plan|status|tasks`: the recipes' command line (absl flags).

`USAGE` is what `posttrain` without a command prints and where `--help` finds a command's usage lines.
"""
from __future__ import annotations

import os
import sys

from posttrain.cli.commands import (UsageError, _enable_compilation_cache, _fake_cpu_devices_for_plan, check_run_flags,
                                    cmd_convert, cmd_domains, cmd_dpo, cmd_eval, cmd_plan, cmd_rm, cmd_sample,
                                    cmd_sft, cmd_train)
from posttrain.cli import status, tasks
from posttrain.cli.flags import command_help, config_file, config_override_argv, define_flags as _flags, flag_error_line

USAGE = """`posttrain train|sft|dpo|rm|eval|sample|convert|domains|plan|status|tasks`: the recipes' command line.

  posttrain train  --config=configs/quickstart.py [--config.rl.group_size=8 ...] [--workdir=DIR]   (GRPO)
  posttrain sft    --config=configs/sft_tiny.py [--workdir=DIR]   (supervised fine-tuning on chat data)
  posttrain dpo    --config=configs/dpo_tiny.py [--workdir=DIR]   (direct preference optimisation on pairs)
  posttrain sft    --from_archive=RUN[,RUN] [--min_reward=1] [--max_per_prompt=1] [--config=...] [--workdir=DIR]
                   (rejection-sampling fine-tuning on a GRPO run's successful episodes; base model: the run's)
  posttrain dpo    --from_archive=RUN[,RUN] [--config=...] [--workdir=DIR]   (pairs from the run's groups: 1 over 0)
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
                    [--floors [--write]]  (gaming floors and golden samples; --write: envs/tasks/domain_floors.json)
  posttrain plan --config=configs/plan/kimi_k2.py --target=v5p-512|h200x256|cpu-8 [--json] [--prompt_len=512] [--nosampler]
                 (compile the train step for that machine without it: fits? per-device memory, FLOPs)
  posttrain tasks check FILE...   (a task file checked before training: docs/task_files.md; `tasks --help`)
  posttrain tasks export --from_archive=RUN --out=FILE.jsonl   (archived episodes as a task file)
Multi-host: start one process per host with --distributed (launch/ has TPU-pod and SLURM scripts).
The current directory is importable, as under `python -m`: an env id 'my_envs:MyEnv-v0' finds ./my_envs.py.
"""

# command name -> its function (a new command: a function in commands.py, a line here, its usage lines in the
# docstring above or its module's (`command_help` reads both) and its flags in flags.py)
COMMANDS = {"train": cmd_train, "eval": cmd_eval, "sample": cmd_sample, "convert": cmd_convert,
            "domains": cmd_domains, "plan": cmd_plan, "sft": cmd_sft, "dpo": cmd_dpo, "rm": cmd_rm,
            "status": status.cmd_status, "tasks": tasks.cmd_tasks}
POSITIONAL = ("tasks",)
LIGHT = ("status", "tasks", "domains")  # commands that run without JAX (no cluster start, no compilation cache)  # commands that take positional arguments after the flags parse (a verb, files)

__all__ = ["COMMANDS", "USAGE", "UsageError", "command_help", "flag_error_line", "main"]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _config_file_error(f, argv) -> str | None:
    """Why --config's file did not load, or None (ml_collections defers the error to the first read of the flag)."""
    try:
        getattr(f.config, "to_dict", None)
    except OSError as e:
        path = config_file(argv).partition("=")[2]
        return f"{config_file(argv)}: " + ("no such file" if path and not os.path.exists(path) else _one_line(e))
    return None


def _import_from_cwd() -> None:
    """Appends the current directory to sys.path, as `python -m` has it, so `module:Env-v0` ids import from there.

    The `posttrain` script's sys.path[0] is its own bin folder; env worker processes inherit sys.path."""
    try:
        cwd = os.getcwd()
    except OSError:  # the directory was removed: nothing there to import
        return
    if all(os.path.abspath(p or os.curdir) != cwd for p in sys.path):  # "" is the current directory
        sys.path.append(cwd)


HASH_SEED = "0"  # PYTHONHASHSEED of a command: str hashing fixed, so every process builds the same tasks


def main(argv=None) -> int:
    if argv is None and "PYTHONHASHSEED" not in os.environ:  # the `posttrain` script: once, before any work
        # reasoning-gym builds some datasets' items by iterating sets of str (isomorphic_strings, knight_swap,
        # polynomial_multiplication, ransom_note, word_ladder): their tasks differ between processes unless str
        # hashing is fixed, and a resumed run or an env worker would see other tasks at the same index
        os.environ["PYTHONHASHSEED"] = HASH_SEED
        os.execv(sys.executable, [sys.executable, "-m", "posttrain.cli", *sys.argv[1:]])
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        if len(argv) >= 2:  # a command the line names that does not exist: say which, and the closest one
            import difflib

            close = difflib.get_close_matches(argv[1], COMMANDS, n=1)
            print(f"error: unknown command {argv[1]!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                  + f"; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    command = argv.pop(1)
    _import_from_cwd()
    if command == "plan":
        _fake_cpu_devices_for_plan(argv)
    f = _flags()
    if any(a in ("--help", "-h", "--helpshort", "--helpfull", "-help") for a in argv[1:]):
        print(command_help(command, f))
        return 0
    parsed, saved = config_override_argv(argv), sys.argv
    try:  # ml_collections reads the --config.* overrides from sys.argv: these, with domain keys subscripted
        sys.argv = parsed
        positional = f(parsed)[1:]
    except Exception as e:  # absl raises its own error types for unknown/invalid flags
        print(f"error: {flag_error_line(e, argv)}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    unreadable = _config_file_error(f, argv)
    if unreadable:
        print(f"error: {unreadable}", file=sys.stderr)
        return 2
    try:
        check_run_flags(f, command)
        asked = f.distributed or os.environ.get("POSTTRAIN_DISTRIBUTED")  # a cluster asked for is started, or refused
        if command not in LIGHT or asked:  # JAX, the cluster and the compilation cache: for the commands that use them
            from posttrain.infra import distributed

            distributed.initialize(True if f.distributed else None)
            if command != "plan":  # a plan measures a real compile (time, buffer report): no persistent cache
                _enable_compilation_cache()
        if command in POSITIONAL:
            return COMMANDS[command](f, positional)
        if positional:
            raise UsageError(f"posttrain {command} takes flags only (--name=value), got {positional}")
        return COMMANDS[command](f)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - `_exit_code` sorts what the user can fix (a
        # signal's RunInterrupted is a KeyboardInterrupt) from what is a bug or a plain Ctrl-C, re-raised
        code = _exit_code(e)
        if code is None:
            raise
        return code


def _loaded(module: str, name: str) -> type:
    """The exception class `name` of `module` when that module is loaded, else a class nothing raises: an exception of
    a module never imported cannot have been raised, so a light command classifies errors without importing JAX."""
    return getattr(sys.modules.get(module), name, _NeverRaised)


class _NeverRaised(Exception):
    """Stands for an exception class whose module was not imported."""


def _exit_code(e: BaseException) -> int | None:
    """Prints the one line of an error the user can act on and returns its exit code; None for a bug (re-raised).

    2: what the user gave is wrong, and nothing was trained or changed: flags; config keys and values (before any
    model load or worker start); data files (path:line); a mesh that does not divide the model; a run that is not
    there (RunNotFoundError: a FileNotFoundError; nothing created, never the base model instead) or whose every
    checkpoint is unreadable; another path that is not there; --distributed without a cluster JAX detects or the
    JAX_* variables that name the peers. 1: the run could not go on (the envs failed a step; the file system
    refused). 128 + the signal's number: SIGINT / SIGTERM, the state saved."""
    from posttrain.errors import ConfigError, DataError

    user = (UsageError, ConfigError, DataError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
            _loaded("posttrain.infra.mesh", "ShardingError"),
            _loaded("posttrain.checkpoints.orbax", "CheckpointCorruptError"),
            _loaded("posttrain.infra.distributed", "DistributedSetupError"))
    if isinstance(e, user):
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    if isinstance(e, _loaded("posttrain.rollout.env_side", "EnvInfraError")):  # the first worker error, one line
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    if isinstance(e, OSError):  # the file system refused (read-only, full disk, permissions): what and where
        print(f"error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1
    if isinstance(e, _loaded("posttrain.infra.distributed", "RunInterrupted")):
        import signal

        print(f"interrupted: {e}", file=sys.stderr)
        return 128 + int(getattr(signal, e.signal_name, signal.SIGINT))
    return None
