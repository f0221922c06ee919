"""`posttrain plan` and the pre-flight check: does a config's GRPO train step fit a machine? (docs/commands.md)

Both compile the step for the target here (no weights allocated, no accelerator needed) and read the program."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import tempfile
import time
from typing import Any

import jax
import numpy as np

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.checkpoints import hf_config, load
from posttrain.checkpoints.gguf import default_model_path, read_hf_config
from posttrain.config.plan import make_run_plan
from posttrain.errors import ConfigError
from posttrain.generate import kv_pages
from posttrain.generate.engine import ops as engine_ops
from posttrain.generate.engine.loop import Request, request_rows
from posttrain.generate.paged_attention import resolve_impl
from posttrain.generate.sampler import sample, shrink_schedule
from posttrain.infra import aot, reshard
from posttrain.infra import mesh as mesh_lib
from posttrain.infra.partitioning import assert_sufficiently_sharded, use_rules
from posttrain.learn.learner import abstract_batch
from posttrain.learn.state import abstract_train_state, model_states
from posttrain.learn.step import jit_step
from posttrain.model import flops as flops_lib
from posttrain.rollout.batching import random_batch

_V5P_TOPOLOGIES = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
                   512: "8x8x8", 1024: "8x8x16"}
_2D_TOPOLOGIES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
# Cloud TPU slice name -> (TensorCores per chip: the N of <name>-N counts them, chips -> topology)
TPU_SLICES = {"v5p": (2, _V5P_TOPOLOGIES), "v5e": (1, _2D_TOPOLOGIES), "v6e": (1, _2D_TOPOLOGIES)}
_KNOWN = "cpu-N, " + ", ".join(f"{k}-N" for k in TPU_SLICES) + " or h200xN"


def target_devices(target: str):
    """(devices, platform, HBM bytes per device, published bf16 peak FLOP/s per device or None) of a target name.

    Raises ValueError for an unknown target or device count, RuntimeError when its compiler is missing."""
    kind, _, count = target.replace("x", "-", 1).partition("-") if target.startswith("h200x") else \
        target.partition("-")
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"target {target!r}: expected {_KNOWN}")
    n = int(count)
    if kind == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < n:
            raise ValueError(f"target cpu-{n} needs {n} CPU devices, this process has {len(devices)}: set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting")
        import psutil

        return devices[:n], "cpu", psutil.virtual_memory().total // n, None
    if kind in TPU_SLICES:
        cores, topologies = TPU_SLICES[kind]
        if n % cores or n // cores not in topologies:
            unit = "TensorCores (2 per chip)" if cores == 2 else "chips"
            raise ValueError(f"target {target}: {kind}-N counts {unit}; supported N: "
                             f"{sorted(cores * c for c in topologies)}")
        t = aot.TARGETS[kind]
        return (aot.target_devices(kind, f"{kind}:{topologies[n // cores]}"), "tpu", t.hbm_bytes,
                t.peak_bf16_flops)
    if kind == "h200":
        hosts, per_host = (1, n) if n <= 8 else (n // 8, 8)
        if hosts * per_host != n:
            raise ValueError(f"target h200x{n}: more than 8 GPUs must be a multiple of 8 (8 per host)")
        t = aot.TARGETS["h200"]
        return aot.target_devices("h200", f"1x{hosts}x{per_host}"), "gpu", t.hbm_bytes, t.peak_bf16_flops
    raise ValueError(f"unknown target {target!r}: expected {_KNOWN}")


@contextlib.contextmanager
def captured_stderr():
    """Captures what C++ code writes to file descriptor 2 (XLA's warnings); yields a dict filled with "text"."""
    out = {"text": ""}
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out["text"] = tmp.read().decode(errors="replace")


def compile_train_step(step_fn, state, state_sh, batch, batch_sh, mesh, rules=mesh_lib.RULES):
    """Compiles `step_fn` on `mesh` as the learner jits it: (MemoryReport, seconds, XLA log, collective bytes)."""
    with jax.set_mesh(mesh), use_rules(rules):
        lowered = jit_step(step_fn, state_sh, batch_sh).lower(state, batch)
        with captured_stderr() as log:
            compiled, report, seconds = aot.compile_with_report(lowered)
    return report, seconds, log["text"], aot.collective_bytes(compiled.as_text())


def compile_sampler(graphdef, policy, mesh, rules, *, prompts: int, prompt_len: int, group_size: int, params,
                    shrink=(), record_routing: bool = False):
    """Compiles the rollout sampler (`sampler.sample`) on `mesh` as the rollouter calls it: (MemoryReport, seconds)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    rep = NamedSharding(mesh, PartitionSpec())
    key = jax.eval_shape(lambda: jax.random.key(0))
    args = (jax.ShapeDtypeStruct((prompts, prompt_len), jnp.int32, sharding=rep),
            jax.ShapeDtypeStruct((prompts,), jnp.int32, sharding=rep),
            jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep))
    with jax.set_mesh(mesh), use_rules(rules):
        lowered = sample.lower(graphdef, policy, *args, group_size=group_size, params=params, stop_ids=(0,),
                               pad_id=0, shrink=tuple(shrink), record_routing=record_routing)
        _, report, seconds = aot.compile_with_report(lowered)
    return report, seconds


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        itemsize = 8 if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) else np.dtype(leaf.dtype).itemsize
        total += math.prod(shape) * itemsize
    return total


def plan_train_step(cfg, target: str, *, prompt_len: int = 512, sampler: bool = True) -> dict:
    """The per-device report (`plan_report`) of `cfg`'s run on `target`, its plan made for the target's devices.

    Raises ConfigError for a config that makes no valid plan there, ValueError / RuntimeError from `target_devices`."""
    devices, platform, hbm, peak = target_devices(target)
    plan = make_run_plan(cfg, num_devices=len(devices), backend=platform)
    return plan_report(plan, devices, hbm, peak, target=target, prompt_len=prompt_len, sampler=sampler)


def plan_report(plan, devices, hbm: int, peak, *, target: str, prompt_len: int = 512, sampler: bool = True) -> dict:
    """The per-device report of `plan` (made for `devices`) on `target` for one step's batch (fields: docs/commands.md).

    `hbm`: bytes per device; `peak`: bf16 FLOP/s per device or None; `sampler`: also compile the rollout sampler
    (`sample_*` keys). ValueError without a model preset (shapes only, no weights are read)."""
    mesh, rollout_mesh = mesh_lib.split_meshes(plan.mesh_shape, plan.rollout_mesh_shape, devices)
    if not plan.policy.preset:
        raise ValueError("plan needs model.preset (shapes only; no weights are read)")
    model_cfg = plan.policy.preset_config()
    c, lora_rank = plan.config, plan.config.lora.rank
    graphdef, step_fn, state, state_sh, batch, batch_abs, batch_sh = abstract_step(plan, mesh, model_cfg, prompt_len,
                                                                                   c.sampling.max_new_tokens)
    assert_sufficiently_sharded((state.params, state.frozen), mesh)  # the whole model (LoRA: adapters + base)
    report, seconds, log, collectives = _compile_or_refusal(step_fn, state, state_sh, batch_abs, batch_sh, mesh,
                                                            plan.rules)
    fl = flops_lib.train_step_flops(model_cfg, state.params if not lora_rank else
                                    flops_lib.abstract_model_state(model_cfg), batch, lora=bool(lora_rank))
    n = len(devices)
    p = plan.precision
    out = {"target": target, "devices": n, "mesh": dict(plan.mesh_shape), "model": plan.policy.preset,
           "packed": c.rl.packed, "sequences": c.rl.prompts_per_step * c.rl.group_size,
           "compute_dtype": p.compute_dtype, "param_dtype": p.param_dtype, "remat": model_cfg.remat,
           "lora_rank": lora_rank,
           "rows": int(batch.tokens_RxL.shape[0]), "row_len": int(batch.tokens_RxL.shape[1]),
           "params": fl.total_params, "params_gib": per_device_bytes(state.params) / aot.GIB,
           "optimizer_gib": per_device_bytes(state.opt_state) / aot.GIB,
           "gradients_gib": per_device_bytes(state.params) / aot.GIB,
           "frozen_gib": per_device_bytes((state.frozen, state.ref_params)) / aot.GIB,
           **report.as_dict(), "hbm_gib": hbm / aot.GIB, "fits": aot.fits(report.peak, hbm),
           "compile_s": None if seconds is None else round(seconds, 1), "flops_per_step": fl.total,
           "collective_gib": {k: round(v / aot.GIB, 3) for k, v in collectives.items()
                              if k in aot.COLLECTIVE_KINDS and v},
           "step_s_estimate": fl.total / n / peak if peak else None,
           "involuntary_remat": "Involuntary full rematerialization" in log,
           "compiler_refused": "RESOURCE_EXHAUSTED" in log}
    policy = model_states(state.params, state.frozen)
    if plan.rollout_mesh_shape:  # split meshes: the sampler's submesh, the policy in its layout, bytes per version
        policy, split = split_report(policy, mesh, rollout_mesh, plan.rules)
        out.update(split)
    if sampler:
        out.update(_sampler_report(graphdef, policy, rollout_mesh, plan, prompt_len, hbm))
        out["fits"] = out["fits"] and out["sample_fits"]
    return out


def split_report(policy, learner_mesh, rollout_mesh, rules=mesh_lib.RULES) -> tuple[Any, dict]:
    """(the abstract `policy` in the rollout submesh's layout, the split keys: mesh, bytes per device and version)."""
    shardings = mesh_lib.state_shardings(policy, rollout_mesh, rules)
    moved = reshard.transfer_bytes(policy, shardings, learner_mesh.devices.flat)
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), policy, shardings)
    return placed, {"rollout_devices": rollout_mesh.size, "rollout_mesh": dict(rollout_mesh.shape),
                    "sample_params_gib": per_device_bytes(placed) / aot.GIB,
                    "transfer_bytes_per_version": moved, "transfer_gib_per_version": moved / aot.GIB}


def _compile_or_refusal(step_fn, state, state_sh, batch_abs, batch_sh, mesh, rules):
    """`compile_train_step`'s (report, seconds, log, collectives); when XLA:TPU refuses to compile a program that
    cannot fit in HBM, a report whose temp is the size it asked for (seconds None, the error as the log)."""
    try:
        return compile_train_step(step_fn, state, state_sh, batch_abs, batch_sh, mesh, rules)
    except Exception as e:  # noqa: BLE001 - the refusal's message carries the size; anything else is re-raised
        needed = re.search(r"required for HLO temporaries \(([\d.]+)G\)", str(e))
        if not needed:
            raise
        report = aot.MemoryReport(per_device_bytes(state), per_device_bytes(state), int(float(needed.group(1)) * 1e9),
                                  per_device_bytes(state), [])
        return report, None, str(e), {}


def compile_engine(graphdef, policy, mesh, settings, *, prompt_len: int) -> tuple[aot.MemoryReport, float, int]:
    """Compiles the rollout engine's decode chunk and prefill on `mesh`'s one device, with `kv_pages.pool_shapes`' pool.

    On TPU with the engine's attention (the Pallas kernel writes the pool in place, where XLA:TPU's scatters copy it),
    else the reference gather. Returns (the larger MemoryReport, seconds of both, the pool's bytes)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    rep = NamedSharding(mesh, PartitionSpec())

    def placed(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)

    S, M = settings.num_slots, settings.pages_per_seq
    pool = placed(kv_pages.pool_shapes(graphdef, policy, settings.num_pages, settings.page_size))
    state = placed(policy)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)  # noqa: E731
    rows = placed(jax.eval_shape(lambda: request_rows([Request(prompt=(0,), max_new_tokens=1)] * S)))
    width = settings.prefill_width(prompt_len)
    platform = mesh.devices.flat[0].platform
    impl = "reference" if platform != "tpu" else resolve_impl("auto", platform, pages_per_seq=M,
                                                              **kv_pages.kernel_shapes(pool))
    K = settings.chunk_steps(platform)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep)  # noqa: E731
    decode = engine_ops.decode_chunk.lower(graphdef, state, pool, i32(S, M), i32(S), i32(S), rows, f32(K, S),
                                           i32(S), i32(S, 1), impl=impl, steps=K)
    prefill = engine_ops.prefill.lower(graphdef, state, pool, i32(1, width), i32(1), i32(1, M))
    reports, seconds = [], 0.0
    for lowered in (decode, prefill):
        _, report, s = aot.compile_with_report(lowered)
        reports.append(report)
        seconds += s
    return max(reports, key=lambda r: r.peak), seconds, per_device_bytes(pool)


def _sampler_report(graphdef, model_state, mesh, plan, prompt_len: int, hbm: int) -> dict:
    """The `sample_*` keys of `plan_report`: the dense sampler, or the engine's programs and page pool."""
    c = plan.config
    if plan.engine is not None:
        settings = plan.engine.engine_settings(prompt_len + c.sampling.max_new_tokens)
        srep, sseconds, pool = compile_engine(graphdef, model_state, mesh, settings, prompt_len=prompt_len)
        sd = srep.as_dict()
        return {"sample_backend": "engine", "sample_peak_gib": sd["peak_gib"], "sample_temp_gib": sd["temp_gib"],
                "sample_kv_pool_gib": pool / aot.GIB, "sample_compile_s": round(sseconds, 1),
                "sample_fits": aot.fits(srep.peak, hbm)}
    rl, samples = c.rl, c.rl.prompts_per_step * c.rl.group_size
    shrink = shrink_schedule(samples, plan.decode_multiple, steps=c.sampling.decode_shrink_steps)
    srep, sseconds = compile_sampler(graphdef, model_state, mesh, plan.rules, prompts=rl.prompts_per_step,
                                     prompt_len=prompt_len, group_size=rl.group_size, params=c.sampling.params(),
                                     shrink=shrink, record_routing=rl.routing_replay == "replay")
    sd = srep.as_dict()
    return {"sample_backend": "dense", "sample_peak_gib": sd["peak_gib"], "sample_temp_gib": sd["temp_gib"],
            "sample_compile_s": round(sseconds, 1), "sample_fits": aot.fits(srep.peak, hbm)}


def fit_verdict(report: dict, target: str) -> str:
    """The line for a plan that does not fit: each program over the limit (train step, sampler), the largest first."""
    limit = aot.HBM_FIT_FRACTION * report["hbm_gib"]
    over = [(p, name) for name, p, ok in (("train step", report["peak_gib"], report["peak_gib"] <= limit),
                                          ("sampler", report.get("sample_peak_gib"), report.get("sample_fits")))
            if ok is False]
    parts = [f"{name} peak {peak:.1f} GiB" for peak, name in sorted(over, reverse=True)]
    return (f"does not fit: {' and '.join(parts) or 'the plan'} per device > {aot.HBM_FIT_FRACTION:.0%} of "
            f"{report['hbm_gib']:.1f} GiB HBM on {target}")


_MACHINE_RE = re.compile(r"^(?:(cpu)-(\d+)(?::(\d+(?:\.\d+)?)GB)?|(v5p|v5e|v6e)-(\d+)|(h200)x(\d+))$")


MACHINE_FORMS = "cpu-N[:<G>GB], v5p-N, v5e-N, v6e-N or h200xN"


@dataclasses.dataclass(frozen=True)
class Machine:
    """A parsed `train.machine`: the `plan --target` name, platform, devices, host memory a CPU config assumes."""

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
    """The ModelConfig a run of `source` builds, read without weights: the preset's, or the checkpoint's with fields."""
    import json
    import pathlib

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
    return default_model_path()


def memory_limit(devices) -> tuple[int, str]:
    """(bytes the run may use, what they are) on `devices`: available host memory, or the least `bytes_limit`."""
    if devices[0].platform == "cpu":
        import psutil

        return psutil.virtual_memory().available, "host memory available"
    limits = [(d.memory_stats() or {}).get("bytes_limit", 0) for d in devices]
    return min(limits), f"{devices[0].device_kind} memory per device"


def abstract_step(plan, mesh, model_cfg, prompt_len: int, completion_len: int):
    """The GRPO train step of `plan` on `mesh` with abstract state and batch (`random_batch`; nothing allocated).

    Returns (graphdef, step_fn, state, state shardings, host batch, abstract batch, batch shardings)."""
    c, ls = plan.config, plan.learner_settings
    opt = ls.build_optimizer()
    graphdef, state, state_sh = abstract_train_state(model_cfg, opt.tx, mesh, plan.rules, lora_rank=ls.lora_rank,
                                                     need_reference=ls.need_reference)
    batch = random_batch(0, advantage_fn(c.rl.advantage), prompts=c.rl.prompts_per_step, group_size=c.rl.group_size,
                         prompt_len=prompt_len, completion_len=completion_len, vocab_size=model_cfg.vocab_size,
                         packed=c.rl.packed, row_multiple=plan.row_multiple)
    batch_abs, batch_sh = abstract_batch(batch, mesh, plan.rules)
    step_fn = plan.step_builder()(graphdef, opt.tx, opt.lr_schedule, model_cfg)
    return graphdef, step_fn, state, state_sh, batch, batch_abs, batch_sh


def compile_step(plan, devices, prompt_len: int) -> dict:
    """The step of `plan` compiled for `devices`: {"peak" (bytes a device), "rows", "row_len", "compile_s", "remat"}."""
    cfg = model_config(plan.policy)
    mesh = mesh_lib.make_mesh(plan.mesh_shape, devices=devices)
    c = plan.config
    _, step_fn, state, state_sh, batch, batch_abs, batch_sh = abstract_step(
        plan, mesh, cfg, prompt_len, c.sampling.max_new_tokens * c.env.max_turns)
    t = time.perf_counter()
    with jax.set_mesh(mesh), use_rules(plan.rules):  # compiled as the learner jits it; JAX's compilation cache
        m = jit_step(step_fn, state_sh, batch_sh).lower(state, batch_abs).compile().memory_analysis()
    peak = aot.MemoryReport(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
                            m.alias_size_in_bytes, []).peak
    return {"peak": peak, "rows": int(batch.tokens_RxL.shape[0]), "row_len": int(batch.tokens_RxL.shape[1]),
            "compile_s": time.perf_counter() - t, "remat": cfg.remat}


def verdict(plan, step: dict, limit: int, what: str, devices: int) -> str | None:
    """The refusal line when `devices` x the step's peak exceeds `aot.HBM_FIT_FRACTION` of `limit`, else None.

    `devices`: how many share `limit` (every CPU device shares the host; 1 for per-device accelerator memory)."""
    need = step["peak"] * devices
    if aot.fits(need, limit):
        return None
    rl, g = plan.config.rl, aot.GIB
    per = f" ({devices} devices x {step['peak'] / g:.1f} GiB)" if devices > 1 else ""
    return (f"pre-flight: the GRPO train step needs {need / g:.1f} GiB at its peak{per}, over "
            f"{aot.HBM_FIT_FRACTION:.0%} of the {limit / g:.1f} GiB {what} (compiled for {step['rows']} rows x "
            f"{step['row_len']} tokens); lower it with model.remat=dots or full (now {step['remat']}), "
            f"rl.num_microbatches (now {plan.step.num_microbatches}), rl.prompts_per_step x rl.group_size (now "
            f"{rl.prompts_per_step} x {rl.group_size}), sampling.max_new_tokens (now "
            f"{plan.config.sampling.max_new_tokens}){'' if rl.packed else ' or rl.packed=True (now False)'}; "
            "train.preflight_prompt_len=0 skips this check")


def check(plan, *, devices=None, limit: tuple[int, str] | None = None) -> dict | None:
    """Runs the pre-flight check: `plan`'s compiled train step against `limit` ((bytes, what); default `memory_limit`).

    Returns the step's figures plus "limit", or None when train.preflight_prompt_len is 0. Raises PreflightError (the
    `verdict` line) when it does not fit, ValueError for a negative train.preflight_prompt_len."""
    prompt_len = plan.config.train.preflight_prompt_len
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
