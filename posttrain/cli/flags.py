"""The command line's flags (absl) and their help: every flag of every command is defined here, once; a flag
belongs to the commands its help names before a colon ("eval/convert: ..."), or to those in `_SHARED_FLAGS`."""
from __future__ import annotations

import re


_OWN: set[str] = set()  # the flags `define_flags` defines, reset to their defaults on every call


def _reset(f) -> None:
    """Drops what an earlier main() in this process left: parsed values, --config.* override flags, and values a
    caller restored (absl's flagsaver) without a parse."""
    if f.is_parsed():
        f.unparse_flags()
    for name in [n for n in f if n in _OWN]:
        f[name].unparse()
    for name in [n for n in f if n.startswith("config.")]:
        delattr(f, name)


def define_flags():
    from absl import flags
    from ml_collections import config_flags

    f = flags.FLAGS
    _reset(f)
    if "workdir" not in f:
        before = set(f)
        config_flags.DEFINE_config_file("config", None, "a configs/*.py file defining get_config()")
        flags.DEFINE_string("workdir", None, "output directory (default: config.train.workdir)")
        flags.DEFINE_string("checkpoint", None, "eval/convert/sample: the workdir of a run whose latest checkpoint "
                            "to use (read only)")
        flags.DEFINE_string("prompt", "What is 12 + 30?", "sample: the user message")
        flags.DEFINE_string("model", None, "sample/convert: a .gguf file or HF directory (default: SmolLM2 GGUF); tasks "
                            "check: the tokenizer of the prompt lengths")
        flags.DEFINE_string("out", None, "convert: output directory (a complete HF model directory); eval --suite: "
                            "the report folder (default eval_reports/<run name>/<suite name>-step<N>); tasks export: the JSONL file")
        flags.DEFINE_string("suite", None, "eval: a configs/eval/*.py suite (domains by capability area); tasks "
                            "check: suites (comma-separated) whose prompts the files must not repeat")
        flags.DEFINE_string("baseline", None, "eval --suite: 'base' (the run's initial policy) or a run's workdir")
        flags.DEFINE_integer("limit", None, "eval --suite: at most this many tasks per domain", lower_bound=1)
        flags.DEFINE_string("domains", None, "eval --suite: only these domains (names or patterns, comma-separated); "
                            "tasks export: the archive domains kept")
        flags.DEFINE_string("from_records", None, "eval: rescore the records of a suite report folder (no sampling)")
        flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"], "convert: the written weights' dtype "
                          "(default: the model's parameter dtype)")
        flags.DEFINE_integer("max_shard_mb", 4096, "convert: safetensors shard size limit in MiB", lower_bound=1)
        flags.DEFINE_string("peft_out", None, "convert --checkpoint of a LoRA run: also write the adapter "
                            "(adapter_config.json + adapter_model.safetensors) here")
        flags.DEFINE_integer("max_new_tokens", 64, "sample: tokens to generate", lower_bound=1)
        flags.DEFINE_string("pattern", "*", "domains: domain names or patterns, comma-separated")
        flags.DEFINE_bool("floors", False, "domains: compute each domain's gaming floor (best mean reward of replies "
                          "without a solution) and golden sample (reference replies of 20 tasks per split)")
        flags.DEFINE_bool("write", False, "domains --floors: store them in envs/tasks/domain_floors.json (the table "
                          "selection reads)")
        flags.DEFINE_float("temperature", 0.0, "sample: 0 = greedy", lower_bound=0.0)
        flags.DEFINE_integer("seed", 0, "sample: the sampling stream (temperature > 0: another seed, another reply)")
        flags.DEFINE_bool("progress", True, "train: show a progress bar")
        flags.DEFINE_string("from_archive", None, "sft/dpo/rm/tasks export: a GRPO run's workdir, or several separated by "
                            "commas (runs of one model): train on their episode archives (sft: the successful replies; "
                            "dpo, rm: pairs from the groups) instead of the config's data; without --config, the runs' "
                            "own model section")
        flags.DEFINE_float("min_reward", None, "sft --from_archive, tasks export: the reward a successful episode reaches "
                           "(default: sft.min_reward, 1)")
        flags.DEFINE_integer("max_per_prompt", None, "sft --from_archive: distinct successful replies kept per prompt "
                             "(default: sft.max_per_prompt, 1)")
        flags.DEFINE_bool("allow_config_change", False, "train: resume a run with settings other than its saved "
                          "config.json (each change recorded with its step in config_changes.jsonl)")
        flags.DEFINE_string("target", "cpu-8", "plan: cpu-N | v5p-N (TensorCores) | h200xN")
        flags.DEFINE_bool("json", False, "plan/status/tasks: print one JSON line")
        flags.DEFINE_integer("prompt_len", 512, "plan: prompt tokens per sequence (completions: sampling.max_new_tokens)",
                             lower_bound=1)
        flags.DEFINE_bool("sampler", True, "plan: also compile the rollout sampler (prefill + decode loop)")
        _define_tasks_flags(flags)
        flags.DEFINE_bool("distributed", False, "multi-host: call jax.distributed.initialize() first "
                          "(also on with POSTTRAIN_DISTRIBUTED=1; see launch/)")
        _OWN.update(n for n in set(f) - before if not n.startswith("config"))
    return f


def _define_tasks_flags(flags) -> None:
    """The flags of `posttrain tasks check|export` only."""
    flags.DEFINE_string("verifier", None, "tasks check: the verifier of rows without one (a name, e.g. numeric, "
                        "or JSON: '{\"name\": \"numeric\", \"tolerance\": 0.01}'; default exact)")
    flags.DEFINE_string("answer_after", None, "tasks check: the answer is the text after the last occurrence of "
                        "this marker in the answer column (GSM8K: ####)")
    flags.DEFINE_string("fields", None, "tasks check: task field=column pairs, e.g. prompt=question,answer=ans")
    flags.DEFINE_string("status", None, "tasks export: archive statuses kept, comma-separated (e.g. ok,wrong)")
    flags.DEFINE_string("steps", None, "tasks export: archive steps kept, A:B inclusive (A: or :B open)")


# flags every command that takes them reads (the others are named by their help's "command:" prefixes)
_SHARED_FLAGS = {"config": ("train", "sft", "dpo", "rm", "eval", "convert", "plan"),
                 "workdir": ("train", "sft", "dpo", "rm", "status"), "distributed": "every command"}


def command_help(command: str, f) -> str:
    """The text of `posttrain <command> --help`: its usage lines and its flags with their defaults and help.

    The usage lines come from `posttrain.cli.USAGE` and the command's own module's docstring; a flag belongs to a command
    its help names before a colon ("eval/convert: ...") or `_SHARED_FLAGS` lists."""
    import re
    import sys

    import posttrain.cli

    module = sys.modules[posttrain.cli.COMMANDS[command].__module__]  # a command's own module: its usage there
    lines = posttrain.cli.USAGE.splitlines() + (module.__doc__ or "").splitlines()
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
        shared = _SHARED_FLAGS.get(name, ())
        if shared == "every command" or command in shared or command in commands:
            out.append(f"  --{name}={flag.default!r}: {' '.join((flag.help or '').split())}")
    if command in _SHARED_FLAGS["config"]:
        import dataclasses

        from posttrain.config import Config

        sections = [field.name for field in dataclasses.fields(Config)]
        out.append(f"  --config.<section>.<key>=VALUE: override any key of the --config file; sections: {sections} "
                   "(keys: the config file, posttrain/config/schema.py)")
    return "\n".join(out)


def flag_error_line(e: BaseException, argv) -> str:
    """One line for a command-line error; an unknown --config.* key with ml_collections' hint, else the keys there."""
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
        if isinstance(c, AttributeError) and "get_config" in str(c):
            return f"{config_file(argv)}: the config file defines no get_config() (configs/*.py return a ConfigDict)"
    text = str(e)
    if "Error whilst parsing config file" in text and "Traceback" in text:  # the file's own error: its last line
        last = " ".join([line for line in text.strip().splitlines() if line.strip()][-1].split())
        m = _RETYPED.search(last)
        if m:  # a value of the wrong type set in the file: the key, the value and the type the key holds
            field, value, got, want = m.groups()
            return (f"{config_file(argv)}: get_config() sets {_key_path(field)} = {value} "
                    f"({_TYPE_NAMES.get(got, 'a ' + got)}); that key holds {_TYPE_NAMES.get(want, 'a ' + want)}")
        return f"{config_file(argv)}: get_config() raised {last}"
    m = re.match(r"flag --(config\.\S+?)=(.*?): (?:invalid literal for int|could not convert string to float|"
                 r"Unable to parse|invalid truth value|\('Non-boolean argument)", " ".join(text.split()))
    if m:  # a --config.* override of the wrong type: the key, the text typed and the type the key holds
        kind = _default_type(m.group(1).removeprefix("config."))
        return f"--{m.group(1)}={m.group(2)}: {m.group(1).removeprefix('config.')} takes {kind}, got {m.group(2)!r}"
    m = re.search(r"Unknown command line flag '(config\.[^']+)'", text)
    if m and not any(a.startswith(("--config=", "-config=")) for a in argv):
        return (f"--{m.group(1)} overrides a key of a config file, and no --config=FILE.py is given: put "
                f"--config=configs/<name>.py before it (e.g. --config=configs/quickstart.py --{m.group(1)}=...)")
    return " ".join(text.split())


# ml_collections' refusal of a value of another type: "Could not override field 'steps' (reference). ten is of
# original type <class 'str'> and cannot be casted to type <class 'int'>"
_RETYPED = re.compile(r"Could not override field '(\w+)' \(reference\)\. (.*) is of original type <class '(\w+)'> "
                      r"and cannot be casted to type <class '(\w+)'>")
_TYPE_NAMES = {"int": "an int", "float": "a float", "str": "a str (text)", "bool": "a bool (True/False)"}


def _default_type(path: str) -> str:
    """What the config key at dotted `path` holds ("an int", ...), from the defaults; "its type" when unknown."""
    from posttrain.config.load import default_config

    node = default_config()
    for part in path.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            return "a value of its type"
    return _TYPE_NAMES.get(type(node).__name__, f"a {type(node).__name__}")


def _key_path(field: str) -> str:
    """The dotted config keys named `field` in the defaults ("train.steps"), or `field` when none or several."""
    from posttrain.config.load import default_config

    def walk(node, prefix):
        for k, v in node.items():
            if hasattr(v, "items") and not isinstance(v, str) and v:
                yield from walk(v, f"{prefix}{k}.")
            elif k == field:
                yield f"{prefix}{k}"
    found = list(walk(default_config(), ""))
    return found[0] if len(found) == 1 else field


def config_file(argv) -> str:
    """The --config=PATH of `argv` ("--config" when there is none)."""
    return next((f"--config={a.split('=', 1)[1]}" for a in argv if a.startswith("--config=")), "--config")


def config_override_argv(argv):
    """`argv` with each `--config.<path>=<value>` whose keys are not all identifiers rewritten to subscripts.

    ml_collections parses the path as Python (`reasoning_gym/chain_sum` is a division): `--config.env.train.
    reasoning_gym/chain_sum.kwargs.size=16` sets `c.env.train["reasoning_gym/chain_sum"]["kwargs"]["size"]`. A key
    holding "." needs the subscript written out (`--config.env.train['a.b'].weight=2`)."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        prefix = next((p for p in ("--config.", "--noconfig.", "-config.", "-noconfig.") if name.startswith(p)), "")
        parts = name[len(prefix):].split(".")
        if prefix and "[" not in name and not all(p.isidentifier() for p in parts):
            arg = prefix.rstrip(".") + "".join(f".{p}" if p.isidentifier() else f"[{p!r}]" for p in parts) + eq + value
        out.append(arg)
    return out
