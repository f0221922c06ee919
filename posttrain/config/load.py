"""Loading a run configuration: an ml-collections ConfigDict -> a validated, frozen `Config` (`schema.py`).

`configs/*.py` files define `get_config() -> ml_collections.ConfigDict`; the CLI applies `--config.a.b=v`
overrides; `from_config_dict` turns the result into a frozen `Config`, rejecting unknown keys, wrong types,
out-of-range numbers and unknown names of what lives below this package (dtypes, remat modes, kernels) with one
`ConfigError` that names the key path. Names of registries above it (advantages, policy losses, KL estimators,
aggregations, optimizers, schedules, eval scorers) are checked against the registries themselves by
`posttrain.runs.plan.make_run_plan`. This is the only module that knows ml_collections.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import fnmatch
import math
import os
import types
import typing
from typing import Any, Mapping

from envs.pool.processes import BACKENDS as ENV_BACKENDS
from posttrain.config.schema import SAMPLING_BACKENDS, Config
from posttrain.infra.precision import DTYPES, PRECISIONS
from posttrain.model.attention_kernels import IMPLS as ATTENTION_IMPLS
from posttrain.model.config import GRAD_DTYPES, REMAT_MODES, REMAT_NAMES
from posttrain.model.gmm import IMPLS as GMM_IMPLS

# (section, key) -> allowed values, from the tables of the packages below config/ that own them; the names of
# registries above it are checked by `posttrain.runs.plan.check_names` against the registries themselves
_CHOICES = {
    ("rl", "routing_replay"): ("off", "replay"),
    ("model", "remat"): REMAT_MODES,
    ("model", "dtype"): ("auto",) + tuple(DTYPES),
    ("model", "param_dtype"): ("auto",) + tuple(DTYPES),
    ("model", "matmul_precision"): PRECISIONS,
    ("model", "moe_gmm_impl"): tuple(i for i in GMM_IMPLS if i != "capacity"),
    ("model", "attention_impl"): ATTENTION_IMPLS,
    ("model", "grad_dtype"): GRAD_DTYPES,
    ("env", "backend"): ENV_BACKENDS,
    ("sampling", "backend"): SAMPLING_BACKENDS,
}
_POSITIVE = (">= 1", lambda v: v >= 1)
_NONNEGATIVE = (">= 0", lambda v: v >= 0)
# (section, key) -> (what is allowed, check): every numeric setting with a bounded range, checked before any work
_RANGES = {
    ("rl", "group_size"): (">= 2 (a group of 1 is its own baseline: every advantage, and so every policy gradient, "
                           "is zero)", lambda v: v >= 2),
    **{("rl", k): _POSITIVE for k in ("prompts_per_step", "num_microbatches", "ppo_epochs",
                                      "minibatches")},
    ("sampling", "max_new_tokens"): _POSITIVE, ("train", "steps"): _POSITIVE, ("eval", "batch_size"): _POSITIVE,
    ("train", "max_nonfinite_skips"): _POSITIVE, ("env", "max_turns"): _POSITIVE, ("checkpoint", "keep"): _POSITIVE,
    ("checkpoint", "every_steps"): _POSITIVE, ("checkpoint", "stop_grace_s"): ("> 0", lambda v: v > 0),
    ("eval", "max_new_tokens"): _POSITIVE,
    ("sampling", "prompt_bucket"): _POSITIVE,
    ("sampling", "temperature"): (">= 0 (0: greedy)", lambda v: v >= 0),
    ("sampling", "top_p"): ("in (0, 1] (1: off)", lambda v: 0 < v <= 1),
    ("sampling", "top_k"): (">= 0 (0: off)", lambda v: v >= 0),
    ("sampling", "decode_shrink_steps"): _NONNEGATIVE,
    ("sampling", "engine_slots"): (">= 0 (0: prompts x group)", lambda v: v >= 0),
    ("sampling", "engine_pages"): ("0 (every slot at its longest) or >= 2 (page 0 is scratch)",
                                   lambda v: v == 0 or v >= 2),
    ("sampling", "engine_page_size"): _POSITIVE, ("sampling", "engine_env_overlap"): _NONNEGATIVE,
    ("sampling", "engine_decode_chunk"): _NONNEGATIVE,
    ("sampling", "engine_max_seq_len"): ("0 (sized by the requests) or >= 2", lambda v: v == 0 or v >= 2),
    ("model", "moe_capacity_factor"): (">= 0 (0: dropless)", lambda v: v >= 0),
    ("model", "moe_ep_capacity_factor"): ("> 0", lambda v: v > 0),
    ("eval", "temperature"): (">= 0 (0: greedy)", lambda v: v >= 0),
    ("rl", "eps_low"): ("in [0, 1) (or -1: the loss's default)", lambda v: v == -1 or 0 <= v < 1),
    ("rl", "eps_high"): (">= 0 (or -1: the loss's default)", lambda v: v == -1 or v >= 0),
    ("rl", "beta"): _NONNEGATIVE, ("rl", "norm_constant"): _NONNEGATIVE,
    ("rl", "tis_cap"): (">= 1 (a cap below 1 scales down every on-policy token's weight), 0 (off), or -1 (the run "
                        "plan's rule: on when rollout.max_staleness > 0)", lambda v: v in (-1, 0) or v >= 1),
    ("rollout", "max_staleness"): _NONNEGATIVE, ("rollout", "stream_chunk"): _NONNEGATIVE,
    ("rl", "dual_clip_c"): ("0 (off) or > 1", lambda v: v == 0 or v > 1),
    ("rl", "max_resample_rounds"): _NONNEGATIVE,
    ("optim", "lr"): ("> 0", lambda v: v > 0), ("optim", "weight_decay"): _NONNEGATIVE,
    ("optim", "grad_clip_norm"): (">= 0 (0: off)", lambda v: v >= 0), ("optim", "warmup_steps"): _NONNEGATIVE,
    ("optim", "b1"): ("in [0, 1)", lambda v: 0 <= v < 1), ("optim", "b2"): ("in [0, 1)", lambda v: 0 <= v < 1),
    ("optim", "eps"): ("> 0", lambda v: v > 0), ("optim", "min_lr_ratio"): ("in [0, 1]", lambda v: 0 <= v <= 1),
    ("env", "max_infra_error_rate"): ("in [0, 1] (1: never stop)", lambda v: 0 <= v <= 1),
    ("env", "num_workers"): _NONNEGATIVE, ("env", "step_timeout_s"): ("> 0", lambda v: v > 0),
    ("env", "max_abs_reward"): ("> 0", lambda v: v > 0),
    ("train", "max_train_seconds"): _NONNEGATIVE, ("train", "seed"): _NONNEGATIVE,
    ("eval", "num_tasks"): _POSITIVE, ("eval", "every_steps"): _NONNEGATIVE,
    ("eval", "seed"): (">= 0, or -1 (train.seed + 1)", lambda v: v >= -1),
    **{("mesh", k): ("-1 (the remaining devices) or >= 1", lambda v: v == -1 or v >= 1)
       for k in ("data", "fsdp", "tensor", "expert", "rollout_tensor")},
    ("mesh", "rollout"): (">= 0 (0: the sampler shares the learner's mesh)", lambda v: v >= 0),
    ("mesh", "rollout_expert"): _POSITIVE,
}


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the dotted key path."""


class DataError(ValueError):
    """A data file or record the config names (SFT conversations, preference pairs, an archive) is missing,
    undecodable or malformed, or leaves nothing to train on; the message names the file and line (`path:line`) or
    the record (`train_examples[i]`). The command line prints it as one line (exit code 2)."""


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
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise ConfigError(f"{section}.{key}={value!r}; expected one of {choices}")
    for (section, key), (allowed, ok) in _RANGES.items():
        value = getattr(getattr(cfg, section), key)
        if not ok(value):
            raise ConfigError(f"{section}.{key}={value!r} is out of range: must be {allowed}")
    try:
        from posttrain.infra import mesh as mesh_lib
        mesh_lib.rules_with_overrides(cfg.mesh.rules)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"mesh.rules={dict(cfg.mesh.rules)!r}: {e}") from None
    free = [k for k in ("data", "fsdp", "tensor", "expert") if getattr(cfg.mesh, k) == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh: at most one axis may be -1, got {['mesh.' + k for k in free]}")
    if cfg.env.backend != "process" and cfg.env.num_workers < 1:
        raise ConfigError(f"env.backend={cfg.env.backend!r} needs env.num_workers >= 1 (its actors), got "
                          f"env.num_workers={cfg.env.num_workers}")
    if cfg.env.domains:
        cfg = _keep_domains(cfg)
    if not cfg.env.train:
        raise ConfigError("env.train is empty: name at least one environment, e.g. posttrain/Arithmetic-v0")
    for section in ("train", "eval"):  # ids and kwargs: `run_plan.check_envs` builds each env before any load
        for name, spec in getattr(cfg.env, section).items():
            if not (isinstance(spec.weight, (int, float)) and spec.weight > 0):
                raise ConfigError(f"env.{section}.{name}.weight={spec.weight!r} is out of range: must be > 0")
    if set(cfg.model.remat_names) - set(REMAT_NAMES):
        raise ConfigError(f"model.remat_names={list(cfg.model.remat_names)}; each must be one of {REMAT_NAMES}")
    if cfg.model.path and cfg.model.preset:
        raise ConfigError("set at most one of model.path and model.preset")
    if cfg.model.path and not os.path.exists(cfg.model.path):
        raise ConfigError(f"model.path={cfg.model.path!r}: no such file or directory (a .gguf file or an HF "
                          "model directory)")
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

