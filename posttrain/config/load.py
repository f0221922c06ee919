"""Loading a run configuration: an ml-collections ConfigDict -> a validated, frozen `Config` (`schema.py`).

`configs/*.py` files define `get_config() -> ml_collections.ConfigDict`; the CLI applies `--config.a.b=v`
overrides; `from_config_dict` turns the result into a frozen `Config`, refusing unknown keys and wrong types here
and out-of-range values and unknown names in each section type's own `__post_init__`, with one `ConfigError` that
names the key path. This is the only module that knows ml_collections.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import fnmatch
import math
import pathlib
import types
import typing
from typing import Any, Mapping

from posttrain.config.schema import Config
from posttrain.errors import ConfigError, DataError, FieldError  # noqa: F401  (the errors of bad config and data)


def convert_section(cls, value, path: str):
    """`value` (a plain mapping / sequence / scalar) converted to `cls` (a schema dataclass or a field type),
    rejecting unknown keys and wrong types. Raises ConfigError naming the dotted key path (`path` prefixes it)."""
    origin = typing.get_origin(cls)
    if dataclasses.is_dataclass(cls):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"unknown config key(s) {[f'{path}.{k}'.lstrip('.') for k in unknown]}; "
                              f"valid keys under {path or 'config'}: {sorted(names)}")
        kwargs = {k: convert_section(hints[k], v, f"{path}.{k}".lstrip(".")) for k, v in value.items()}
        try:
            return cls(**kwargs)
        except FieldError as e:  # one field out of range or not one of its choices: named by its full path
            raise ConfigError(f"{path}.{e}".lstrip(".")) from e
        except (TypeError, ValueError) as e:  # the dataclass's own validation
            raise ConfigError(f"{path or 'config'}: {' '.join(str(e).split())}") from e
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(cls)
        if value is None and type(None) in args:
            return None
        return convert_section(next(a for a in args if a is not type(None)), value, path)
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list/tuple, got {value!r}")
        return tuple(value)
    if origin in (Mapping, dict, collections.abc.Mapping) or cls is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        item = typing.get_args(cls)[1] if typing.get_args(cls) else Any
        return {k: (convert_section(item, v, f"{path}.{k}") if item is not Any else _plain(v))
                for k, v in value.items()}
    if cls is Any:
        return _plain(value)
    if cls is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if cls in (int, float, str, bool) and (not isinstance(value, cls) or (cls is int and isinstance(value, bool))):
        raise ConfigError(f"{path}: expected {cls.__name__}, got {value!r} ({type(value).__name__})")
    if cls is float and not math.isfinite(value):  # no float setting means anything at inf or nan
        raise ConfigError(f"{path}: expected a finite number, got {value!r}")
    return value


def unknown_key_message(path: str, key: str, value: str = "...") -> str:
    """One line for a --config.<path>=<value> override whose `key` the config lacks: the schema's keys at that
    level, or, under a dict field (model.overrides, env.train, an env's kwargs), how to add the key (in the config
    file)."""
    parts = path.split(".")[1:]
    if key not in parts:
        return f"unknown config key {path}"
    parent = parts[:parts.index(key)]
    node = Config
    for part in parent:
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        node = hints.get(part)
        if node is None or not dataclasses.is_dataclass(node):
            break
    where = ".".join(parent) or "config"
    if node is not None and dataclasses.is_dataclass(node):
        return (f"unknown config key {path}: {where} has no key {key!r}; its keys: "
                f"{sorted(fl.name for fl in dataclasses.fields(node))}")
    return (f"unknown config key {path}: {where} is a dict without the key {key!r}, and the command line only "
            f"changes keys that exist; add it in the config file (e.g. c.{where}[{key!r}] = {value})")


def _plain(v):
    """ConfigDict/FrozenConfigDict -> nested dict (for free-form kwargs)."""
    if isinstance(v, Mapping) or hasattr(v, "to_dict"):
        d = v.to_dict() if hasattr(v, "to_dict") else v
        return {k: _plain(x) for k, x in d.items()}
    if isinstance(v, list):
        return tuple(_plain(x) for x in v)
    return v


def as_config(cfg) -> Config:
    """`cfg` as a validated Config: a Config as is; a ConfigDict or a plain nested dict through `from_config_dict`
    (ConfigError naming a bad key). Raises TypeError for anything else (e.g. a path: load it with
    `ml_collections.config_flags` or call the config file's get_config())."""
    if isinstance(cfg, Config):
        return cfg
    if hasattr(cfg, "to_dict") or isinstance(cfg, Mapping):
        return from_config_dict(cfg)
    raise TypeError(f"expected a posttrain Config, or the ConfigDict a configs/*.py get_config() returns, got "
                    f"{type(cfg).__name__} {str(cfg)[:80]!r}")


def from_config_dict(cd) -> Config:
    """Converts a ConfigDict (or plain nested dict) into a validated, frozen `Config`.

    Raises:
      ConfigError: unknown keys, wrong types, out-of-range or unknown choice values (names the key path).
    """
    raw = cd.to_dict() if hasattr(cd, "to_dict") else dict(cd)
    cfg = convert_section(Config, raw, "")
    if cfg.env.domains:
        cfg = _keep_domains(cfg)
    if not cfg.env.train:
        raise ConfigError("env.train is empty: name at least one environment, e.g. posttrain/Arithmetic-v0")
    return cfg


def _keep_domains(cfg: Config) -> Config:
    """`cfg` with env.train and env.eval cut to the names matching a pattern of `env.domains`, and tasks.policies
    to the patterns that still match a kept name (a config's policy for a domain the selection left out is not an
    error). Raises ConfigError on an empty pattern list or a pattern that matches no env.train name."""
    patterns = [p.strip() for p in cfg.env.domains.split(",") if p.strip()]
    if not patterns:
        raise ConfigError(f"env.domains={cfg.env.domains!r}: no pattern (comma-separated names or fnmatch patterns)")
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in cfg.env.train):
            raise ConfigError(f"env.domains: pattern {pattern!r} matches no env.train name; names: "
                              f"{sorted(cfg.env.train)}")

    def keep(specs):
        return {n: s for n, s in specs.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}

    train = keep(cfg.env.train)
    policies = {p: v for p, v in cfg.tasks.policies.items() if any(fnmatch.fnmatchcase(n, p) for n in train)}
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, train=train, eval=keep(cfg.env.eval)),
                               tasks=dataclasses.replace(cfg.tasks, policies=policies))


def to_dict(cfg: Config) -> dict:
    """Plain nested dict of a Config (JSON-serialisable; stored with checkpoints)."""
    return dataclasses.asdict(cfg)


def config_changes(saved: Mapping, new: Mapping, free: tuple = (), defaults: Mapping | None = None,
                   ) -> dict[str, tuple]:
    """{dotted key: (saved value, new value)} of the settings that differ between two config dicts (JSON-normal
    values: tuples as lists), the dotted keys in `free` left out. With `defaults` (the default Config's dict), a
    key the saved dict lacks (a field added after that run was saved) whose new value is its default is no change:
    the saved run ran with that default's behaviour."""
    import json

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, Mapping) and v:
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    a, b, dflt = (flat(json.loads(json.dumps(d or {}, default=str))) for d in (saved, new, defaults))
    added = {k for k in set(b) - set(a) if k in dflt and b[k] == dflt[k]}
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in free and k not in added}


def default_config():
    """An `ml_collections.ConfigDict` holding every default of `Config` (the base that configs/*.py edit).

    Example (a config file)::

        from posttrain.config import default_config, env_spec
        def get_config():
            c = default_config()
            c.env.train = {"arithmetic": env_spec("posttrain/Arithmetic-v0", split="train")}
            return c
    """
    import ml_collections

    return ml_collections.ConfigDict(to_dict(Config()))


def env_spec(env_id: str, weight: float = 1.0, **kwargs):
    """A ConfigDict for one entry of `env.train` / `env.eval`: an env id, its mix weight and constructor kwargs."""
    import ml_collections

    return ml_collections.ConfigDict({"id": env_id, "weight": weight, "kwargs": kwargs})


# `mesh.rules` for MLA models on large meshes (DeepSeek-V3, Kimi K2): the latent projections' logical axes are
# replicated by default; split over fsdp instead (replicated, DeepSeek-V3's q_b_proj alone took 8 GiB of float32
# weights per device, and as much again per Adam moment and gradient)
MLA_LATENTS_OVER_FSDP = {"q_lora": "fsdp", "kv_lora": "fsdp"}


def dryrun_config(preset: str, variant: str = "full", *, mesh: Mapping[str, int] | None = None,
                rules: Mapping[str, Any] | None = None):
    """The config of a `posttrain plan` dry run (configs/plan/*.py) for a model preset: one GRPO step on a global
    batch of 256 sequences x 4096 tokens (16 prompts x 16 samples, unpacked rows of 512 prompt tokens (plan's
    default `--prompt_len=512`) + 3584 completion tokens), bf16 compute, full remat, no accumulation microbatches.

    variant "full": float32 master weights and Adam moments; "lora": rank-64 adapters on the dense projections,
    frozen bf16 base weights, 4 accumulation microbatches (select it with `--config=configs/plan/<model>.py:lora`).
    mesh: axis sizes (default all devices on fsdp); rules: `mesh.rules` overlays. Raises ConfigError for another
    variant.
    """
    if variant not in ("full", "lora"):
        raise ConfigError(f"plan variant {variant!r}: expected 'full' or 'lora' "
                          "(--config=configs/plan/<model>.py:lora)")
    c = default_config()
    c.model.preset = preset
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32" if variant == "full" else "bfloat16"
    c.model.remat = "full"
    c.env.train = {"arithmetic": env_spec("posttrain/Arithmetic-v0")}  # a plan compiles the step only
    c.rl.prompts_per_step, c.rl.group_size, c.rl.packed = 16, 16, False  # 256 rows: one per device on 256
    c.sampling.max_new_tokens = 4096 - 512
    for axis, size in dict(mesh or {"fsdp": -1}).items():
        setattr(c.mesh, axis, size)
    c.mesh.rules = dict(rules or {})
    if variant == "lora":  # sized for 64 devices (v5p-128): 4 rows each, one per accumulation microbatch
        c.lora.rank, c.lora.alpha, c.rl.num_microbatches = 64, 128.0, 4
    return c


RUN_SHAPE_SECTIONS = ("model", "lora")  # what a run's checkpoints are shaped by: always the run's own


def saved_config(workdir) -> Config | None:
    """The Config a run saved in `workdir`/config.json (what its steps ran with), or None when there is none.
    Raises ConfigError naming the file when it does not load."""
    import json

    from posttrain.config import from_config_dict

    path = pathlib.Path(workdir) / "config.json"
    if not path.is_file():
        return None
    try:
        return from_config_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:  # ConfigError is a ValueError; a truncated file is a JSONDecodeError
        raise ConfigError(f"{path}: {' '.join(str(e).split())}") from None


def config_for_run(workdir, cfg: Config | None = None) -> Config:
    """The config of a command that reads the run in `workdir` (eval, convert): its saved config.json alone; with
    `cfg` (a --config), cfg with the run's own `model` and `lora` sections (RUN_SHAPE_SECTIONS: what its
    checkpoints were trained as, so a forgotten --config.lora.rank cannot mismatch them; a difference is logged).
    Raises ConfigError when the run saved no config and no `cfg` is given."""
    saved = saved_config(workdir)
    if saved is None:
        if cfg is None:
            raise ConfigError(f"{workdir}: no config.json in it (not a run's directory?); pass the run's "
                              "--config=configs/X.py")
        return cfg
    if cfg is None:
        return saved
    from posttrain.infra.metrics import log

    theirs = {s: getattr(saved, s) for s in RUN_SHAPE_SECTIONS}
    differ = config_changes({s: to_dict(cfg)[s] for s in RUN_SHAPE_SECTIONS}, {s: to_dict(saved)[s] for s in theirs})
    if differ:
        log.warning("--checkpoint=%s: using the run's own %s", workdir,
                    ", ".join(f"{k}={new!r} (not {old!r})" for k, (old, new) in differ.items()))
    return dataclasses.replace(cfg, **theirs)
