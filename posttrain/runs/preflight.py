"""Pre-flight memory check: before a GRPO run loads its model, starts workers or writes anything, its train step is
compiled abstractly (shapes only, as `posttrain plan` compiles it) for the machine actually running, and a step
whose compiled peak exceeds 90% of the memory there stops the run with one line naming the peak, the limit and the
settings that would lower it.

Memory: `aot.MemoryReport.peak`'s sum (arguments + outputs - aliases + temp of `compiled.memory_analysis()`) per
device; on the CPU its temp equals the buffer assignment's temp allocation that `posttrain plan` reads (3.52 GiB
both ways for configs/quickstart.py), and the compile goes through JAX's persistent compilation cache (when the
command enabled it), so a repeated start loads it instead of compiling. On the CPU the
devices share the host, so the peak of every local device is held against the host's available memory
(`psutil.virtual_memory().available`); on an accelerator, each device's against its `memory_stats()["bytes_limit"]`.
The batch compiled is `rollout.batching.random_batch`: rl.prompts_per_step prompts of `train.preflight_prompt_len`
tokens, each with rl.group_size completions of env.max_turns x sampling.max_new_tokens tokens, packed per the plan
(tool output inside a multi-turn episode is not counted). The sampler is not compiled: at the shipped configs'
sizes its KV cache is a small share of the train step's activations.

Machines (`train.machine`): `posttrain plan` target names, "cpu-N:<G>GB" for N CPU devices on a host of G GB.
"""
from __future__ import annotations

import dataclasses
import re
import time

from posttrain.config import ConfigError
from posttrain.infra import aot

_MACHINE_RE = re.compile(r"^(?:(cpu)-(\d+)(?::(\d+(?:\.\d+)?)GB)?|(v5p|v5e|v6e)-(\d+)|(h200)x(\d+))$")
MACHINE_FORMS = "cpu-N[:<G>GB], v5p-N, v5e-N, v6e-N or h200xN"


@dataclasses.dataclass(frozen=True)
class Machine:
    """A parsed `train.machine`.

    Attributes:
        target: the `posttrain plan --target` name (the CPU memory suffix dropped).
        platform: "cpu", "tpu" or "gpu".
        devices: devices the config is written for.
        host_bytes: the host memory a CPU config assumes (None when not stated, and for accelerators).
    """

    target: str
    platform: str
    devices: int
    host_bytes: int | None = None


class PreflightError(ConfigError):
    """The train step's compiled peak memory does not fit the machine running it (raised before any work)."""


def parse_machine(name: str) -> Machine:
    """The `Machine` of a `train.machine` value. Raises ValueError naming the value and the allowed forms."""
    m = _MACHINE_RE.match(str(name))
    if not m or int(m.group(2) or m.group(5) or m.group(7)) < 1:
        raise ValueError(f"train.machine={name!r}: expected {MACHINE_FORMS} (e.g. 'cpu-1:24GB', 'v5p-256')")
    if m.group(1):
        gb = m.group(3)
        return Machine(f"cpu-{m.group(2)}", "cpu", int(m.group(2)), int(float(gb) * 1e9) if gb else None)
    if m.group(4):
        return Machine(f"{m.group(4)}-{m.group(5)}", "tpu", int(m.group(5)))
    return Machine(f"h200x{m.group(7)}", "gpu", int(m.group(7)))


def model_config(source):
    """The ModelConfig a run of `source` (a `checkpoints.policy.PolicySource`) builds, read without weights: the
    preset's, or the checkpoint's config (GGUF header or config.json) with the run's fields."""
    import json
    import pathlib

    from posttrain.checkpoints import hf_config, load
    from posttrain.checkpoints.gguf import read_hf_config

    if source.preset:
        return source.preset_config()
    path = pathlib.Path(source.path or _default_path())
    fields = dict(source.fields)
    dtype, param_dtype = fields.pop("dtype", None), fields.pop("param_dtype", None)
    if path.is_file():
        hf, types = read_hf_config(path)
        own = load.gguf_file_dtype(types)
        dtype, param_dtype = dtype or own, param_dtype or own
    else:
        hf = json.loads((path / "config.json").read_text())
    cfg = hf_config.config_from_hf(hf, dtype=dtype, param_dtype=param_dtype)
    return dataclasses.replace(cfg, **fields)


def _default_path():
    from posttrain.checkpoints.gguf import default_model_path

    return default_model_path()


def memory_limit(devices) -> tuple[int, str]:
    """(bytes the run may use, what they are) on `devices`: the host's available memory on the CPU, the smallest
    device's `bytes_limit` on an accelerator."""
    if devices[0].platform == "cpu":
        import psutil

        return psutil.virtual_memory().available, "host memory available"
    limits = [(d.memory_stats() or {}).get("bytes_limit", 0) for d in devices]
    return min(limits), f"{devices[0].device_kind} memory per device"


def compile_step(plan, devices, prompt_len: int) -> dict:
    """The train step of `plan` compiled for `devices` (abstract state and batch; see the module doc): {"peak":
    bytes per device, "rows", "row_len", "compile_s"}."""
    import jax

    from posttrain.algos.grpo.advantages import advantage_fn
    from posttrain.infra import mesh as mesh_lib
    from posttrain.infra.partitioning import use_rules
    from posttrain.learn.learner import abstract_batch
    from posttrain.learn.state import abstract_train_state
    from posttrain.learn.step import jit_step
    from posttrain.runs.plan import step_builder
    from posttrain.rollout.batching import random_batch

    cfg = model_config(plan.policy)
    mesh = mesh_lib.make_mesh(plan.mesh_shape, devices=devices)
    opt = plan.learner.optimizer.build()
    graphdef, state, state_sh = abstract_train_state(cfg, opt.tx, mesh, plan.rules,
                                                            lora_rank=plan.learner.lora_rank,
                                                            need_reference=plan.learner.need_reference)
    ro = plan.rollout
    batch = random_batch(0, advantage_fn(plan.advantage), prompts=ro.prompts_per_step, group_size=ro.group_size,
                         prompt_len=prompt_len, completion_len=ro.sampling.max_new_tokens * ro.max_turns,
                         vocab_size=cfg.vocab_size, packed=ro.packed, row_multiple=ro.row_multiple)
    batch_abs, batch_sh = abstract_batch(batch, mesh, plan.rules)
    step_fn = step_builder(plan)(graphdef, opt.tx, opt.lr_schedule, cfg)
    t = time.perf_counter()
    with jax.set_mesh(mesh), use_rules(plan.rules):  # compiled as the learner jits it; JAX's compilation cache
        m = jit_step(step_fn, state_sh, batch_sh).lower(state, batch_abs).compile().memory_analysis()
    peak = aot.MemoryReport(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
                            m.alias_size_in_bytes, []).peak
    return {"peak": peak, "rows": int(batch.tokens_RxL.shape[0]), "row_len": int(batch.tokens_RxL.shape[1]),
            "compile_s": time.perf_counter() - t, "remat": cfg.remat}


def verdict(plan, step: dict, limit: int, what: str, devices: int) -> str | None:
    """The refusal line when `devices` x the step's peak exceeds `aot.HBM_FIT_FRACTION` of `limit` (CPU: the
    devices share the host; pass devices=1 for per-device accelerator memory), else None."""
    need = step["peak"] * devices
    if aot.fits(need, limit):
        return None
    ro, g = plan.rollout, aot.GIB
    per = f" ({devices} devices x {step['peak'] / g:.1f} GiB)" if devices > 1 else ""
    return (f"pre-flight: the GRPO train step needs {need / g:.1f} GiB at its peak{per}, over "
            f"{aot.HBM_FIT_FRACTION:.0%} of the {limit / g:.1f} GiB {what} (compiled for {step['rows']} rows x "
            f"{step['row_len']} tokens); lower it with model.remat=dots or full (now {step['remat']}), "
            f"rl.num_microbatches (now {plan.step.num_microbatches}), rl.prompts_per_step x rl.group_size (now "
            f"{ro.prompts_per_step} x {ro.group_size}), sampling.max_new_tokens (now {ro.sampling.max_new_tokens})"
            f"{'' if ro.packed else ' or rl.packed=True (now False)'}; train.preflight_prompt_len=0 skips this check")


def check(plan, *, devices=None, limit: tuple[int, str] | None = None) -> dict | None:
    """Runs the pre-flight check of `plan` on `devices` (default: the local devices its mesh uses) against `limit`
    ((bytes, what); default `memory_limit`). Returns the step's figures plus "limit" (None when
    train.preflight_prompt_len is 0). Raises PreflightError with the `verdict` line when the step does not fit,
    ValueError for a negative train.preflight_prompt_len."""
    import math

    import jax

    prompt_len = plan.train.preflight_prompt_len
    if prompt_len < 0:
        raise ValueError(f"train.preflight_prompt_len={prompt_len}: expected >= 0 (0 skips the check)")
    if not prompt_len:
        return None
    devices = devices or jax.local_devices()[:math.prod(plan.mesh_shape.values())]
    limit_bytes, what = limit or memory_limit(devices)
    step = compile_step(plan, devices, prompt_len)
    line = verdict(plan, step, limit_bytes, what, len(devices) if devices[0].platform == "cpu" else 1)
    if line:
        raise PreflightError(line)
    return {**step, "limit": limit_bytes}
