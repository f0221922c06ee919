"""Loading a run configuration: a ConfigDict (a `configs/*.py` file's, `--config.*` overrides applied) -> a `Config`.

Unknown keys and wrong types are refused here, out-of-range values by each section type's `__post_init__`."""
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
    """Converts `value` (a plain mapping, sequence or scalar) to `cls` (a config dataclass or a field type).

    Raises ConfigError naming the dotted key path (prefixed by `path`): an unknown key, a wrong type or a bad value."""
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
    """The line for a --config override of a missing `key`: the keys at that level, or under a dict, how to add it."""
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
    """`cfg` as a validated Config: a Config as is, a ConfigDict or dict through `from_config_dict`; else TypeError."""
    if isinstance(cfg, Config):
        return cfg
    if hasattr(cfg, "to_dict") or isinstance(cfg, Mapping):
        return from_config_dict(cfg)
    raise TypeError(f"expected a posttrain Config, or the ConfigDict a configs/*.py get_config() returns, got "
                    f"{type(cfg).__name__} {str(cfg)[:80]!r}")


def from_config_dict(cd) -> Config:
    """Converts a ConfigDict (or plain nested dict) into a validated, frozen `Config`, `env.domains` applied.

    Raises:
        ConfigError: unknown keys, wrong types, out-of-range or unknown choice values (names the key path), an empty
            env.train or an env.domains pattern that matches no env.train name."""
    raw = cd.to_dict() if hasattr(cd, "to_dict") else dict(cd)
    cfg = convert_section(Config, raw, "")
    if cfg.env.domains:
        cfg = _keep_domains(cfg)
    if not cfg.env.train:
        raise ConfigError("env.train is empty: name at least one environment, e.g. posttrain/Arithmetic-v0")
    return cfg


def _keep_domains(cfg: Config) -> Config:
    """`cfg` with env.train, env.eval and tasks.policies cut to the names the patterns of `env.domains` match."""
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
    """{dotted key: (saved, new)} of the settings two config dicts differ in (JSON-normal), keys in `free` left out.

    With `defaults`, a key the saved dict lacks whose new value is its default is no change (that run ran with it)."""
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
    """An `ml_collections.ConfigDict` of every default of `Config`: the base a configs/*.py file edits."""
    import ml_collections

    return ml_collections.ConfigDict(to_dict(Config()))


def env_spec(env_id: str, weight: float = 1.0, **kwargs):
    """A ConfigDict for one entry of `env.train` / `env.eval`: an env id, its mix weight and constructor kwargs."""
    import ml_collections

    return ml_collections.ConfigDict({"id": env_id, "weight": weight, "kwargs": kwargs})


# `mesh.rules` for MLA models on large meshes (DeepSeek-V3, Kimi K2): the latent projections, replicated by default,
# split over fsdp (replicated, DeepSeek-V3's q_b_proj alone is 8 GiB of float32 weights per device, and as much again
# per Adam moment and gradient)
MLA_LATENTS_OVER_FSDP = {"q_lora": "fsdp", "kv_lora": "fsdp"}


def dryrun_config(preset: str, variant: str = "full", *, mesh: Mapping[str, int] | None = None,
                rules: Mapping[str, Any] | None = None):
    """The config of a `posttrain plan` dry run (configs/plan/*.py) of a model preset: one GRPO step of 256 sequences.

    16 prompts x 16 samples of 512 + 3584 tokens, unpacked, bf16 compute, full remat. `variant` "full": float32 master
    weights and Adam moments; "lora" (else ConfigError): rank-64 adapters, frozen bf16 base, 4 microbatches. `mesh`:
    axis sizes (default: all devices on fsdp); `rules`: `mesh.rules` overlays."""
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
    """The Config saved in `workdir`/config.json (None without one); ConfigError naming the file if it does not load."""
    import json

    path = pathlib.Path(workdir) / "config.json"
    if not path.is_file():
        return None
    try:
        return from_config_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:  # ConfigError is a ValueError; a truncated file is a JSONDecodeError
        raise ConfigError(f"{path}: {' '.join(str(e).split())}") from None


def config_for_run(workdir, cfg: Config | None = None) -> Config:
    """The config of a command that reads the run in `workdir` (eval, convert): its saved config.json.

    With `cfg` (a --config): `cfg` with the run's own RUN_SHAPE_SECTIONS, what its checkpoints were trained as (a
    difference is logged). Raises ConfigError when the run saved no config and no `cfg` is given."""
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
