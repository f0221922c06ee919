"""`posttrain plan`: does this config's GRPO train step fit that machine? Answered by compiling it for the target
topology on this machine (no weights allocated, no accelerator needed) and reading the compiled program.

Targets: `cpu-N` (N local CPU devices; fake them with XLA_FLAGS=--xla_force_host_platform_device_count=N),
`v5p-N` (Cloud TPU naming: N TensorCores = N/2 chips), `v5e-N` and `v6e-N` (N chips of one TensorCore each; Colab's
TPU runtimes are v5e-1 and v6e-1), all three needing the `tpu` extra, and `h200xN` (N GPUs, 8 per host; needs the
`aot` extra). The mesh is the config's `mesh` resolved for the target's device count, parameters are sharded by
the same rules as training, and the step is the training step (policy loss, reference KL when configured,
optimizer update), jitted with the same shardings and donation.

Per device: parameter, optimizer and gradient bytes (from the shardings), the compiled program's temp bytes and
peak (`aot.MemoryReport.peak`: arguments + outputs - aliases + the buffer assignment's temp allocation), peak vs
HBM (fits at <= 90%), analytic model FLOPs (`posttrain.model.flops`; XLA's cost analysis counts a scanned layer once),
a step-time estimate at the chip's published peak FLOP/s, the
compile time, and whether XLA logged "Involuntary full rematerialization" (a sharding that forces whole arrays to
be rematerialised), collective bytes by kind (`aot.collective_bytes`: scanned layers counted per trip), and the
same for the rollout sampler (prefill + decode loop) unless `sampler=False`.

Split meshes (`mesh.rollout`): the train step compiles on the learner's devices (the first ones), the sampler on
the rollout submesh (the last `mesh.rollout`) with the policy in its inference layout, and the report adds the
rollout mesh, the policy bytes per rollout device and the bytes each policy version moves from the learner's
devices to the rollout's (`split_report`).
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
from typing import Any

import jax
import numpy as np

from posttrain.infra import aot
from posttrain.infra import mesh as mesh_lib
from posttrain.learn.learner import abstract_batch
from posttrain.learn.state import abstract_train_state
_V5P_TOPOLOGIES = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
                   512: "8x8x8", 1024: "8x8x16"}
_2D_TOPOLOGIES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
# Cloud TPU slice name -> (TensorCores per chip: the N of <name>-N counts them, chips -> topology)
TPU_SLICES = {"v5p": (2, _V5P_TOPOLOGIES), "v5e": (1, _2D_TOPOLOGIES), "v6e": (1, _2D_TOPOLOGIES)}
_KNOWN = "cpu-N, " + ", ".join(f"{k}-N" for k in TPU_SLICES) + " or h200xN"


def target_devices(target: str):
    """(devices, platform, hbm bytes per device, published bf16 peak FLOP/s per device or None) for a target name.

    Raises ValueError for an unknown target or a device count the target cannot have, RuntimeError when the
    compiler for the target is missing (the message names the install command).
    """
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
    """Lowers and compiles the pure step `step_fn`, jitted as the learner jits it (`learn.step.jit_step`: explicit
    shardings, state donated), for `mesh` (activation constraints by `rules`); returns (MemoryReport, compile
    seconds, XLA log, collective bytes by kind per device: `aot.collective_bytes`)."""
    from posttrain.infra.partitioning import use_rules
    from posttrain.learn.step import jit_step

    with jax.set_mesh(mesh), use_rules(rules):
        lowered = jit_step(step_fn, state_sh, batch_sh).lower(state, batch)
        with captured_stderr() as log:
            compiled, report, seconds = aot.compile_with_report(lowered)
    return report, seconds, log["text"], aot.collective_bytes(compiled.as_text())


def compile_sampler(graphdef, policy, mesh, rules, *, prompts: int, prompt_len: int, group_size: int, params,
                    shrink=(), record_routing: bool = False):
    """Lowers and compiles the rollout sampler (`sampler.sample`: prefill, then the decode loop over
    `model.decode_step`) for `mesh` with the policy's abstract states, as the rollouter calls it (prompts
    replicated on entry, activations split by `rules`); returns (MemoryReport, compile seconds)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from posttrain.infra.partitioning import use_rules
    from posttrain.generate.sampler import sample

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
    """The per-device report of `cfg`'s run on `target` (see `plan_report`): the run plan is made for the target's
    devices and backend. Raises ConfigError for a config that makes no valid plan on the target,
    ValueError/RuntimeError from `target_devices`."""
    from posttrain.runs.plan import make_run_plan

    devices, platform, hbm, peak = target_devices(target)
    plan = make_run_plan(cfg, num_devices=len(devices), backend=platform)
    return plan_report(plan, devices, hbm, peak, target=target, prompt_len=prompt_len, sampler=sampler)


def plan_report(plan, devices, hbm: int, peak, *, target: str, prompt_len: int = 512, sampler: bool = True) -> dict:
    """The per-device report of the run plan `plan` (made for `devices`) on `target` (see the module doc; hbm:
    bytes per device; peak: bf16 FLOP/s per device or None) for one step's batch:
    rollout.prompts_per_step prompts of `prompt_len` tokens, each with group_size completions of the sampling's
    max_new_tokens, packed per the plan; with `sampler`, also the rollout sampler's compile for the same prompts
    (`sample_*` keys; `fits` then needs both). The step compiled is the learner's: the GRPO recipe's step builder
    jitted by `learn.step.jit_step`. Raises ValueError without a model preset (shapes only, no weights)."""
    from posttrain.algos.grpo.advantages import advantage_fn
    from posttrain.infra.partitioning import assert_sufficiently_sharded
    from posttrain.learn.state import model_states
    from posttrain.model import flops as flops_lib
    from posttrain.recipes.grpo import step_builder
    from posttrain.rollout.batching import random_batch

    mesh, rollout_mesh = mesh_lib.split_meshes(plan.mesh_shape, plan.rollout_mesh_shape, devices)
    if not plan.policy.preset:
        raise ValueError("plan needs model.preset (shapes only; no weights are read)")
    model_cfg = plan.policy.preset_config()
    opt = plan.learner.optimizer.build()
    lora_rank = plan.learner.lora_rank
    graphdef, state, state_sh = abstract_train_state(model_cfg, opt.tx, mesh, plan.rules, lora_rank=lora_rank,
                                                     need_reference=plan.learner.need_reference)
    assert_sufficiently_sharded((state.params, state.frozen), mesh)  # the whole model (LoRA: adapters + base)
    ro = plan.rollout
    batch = random_batch(0, advantage_fn(plan.advantage), prompts=ro.prompts_per_step, group_size=ro.group_size,
                         prompt_len=prompt_len, completion_len=ro.sampling.max_new_tokens,
                         vocab_size=model_cfg.vocab_size, packed=ro.packed, row_multiple=ro.row_multiple)
    batch_abs, batch_sh = abstract_batch(batch, mesh, plan.rules)
    step_fn = step_builder(plan)(graphdef, opt.tx, opt.lr_schedule, model_cfg)
    report, seconds, log, collectives = _compile_or_refusal(step_fn, state, state_sh, batch_abs, batch_sh, mesh,
                                                            plan.rules)
    fl = flops_lib.train_step_flops(model_cfg, state.params if not lora_rank else
                                    flops_lib.abstract_model_state(model_cfg), batch, lora=bool(lora_rank))
    n = len(devices)
    p = plan.precision
    out = {"target": target, "devices": n, "mesh": dict(plan.mesh_shape), "model": plan.policy.preset,
           "packed": ro.packed, "sequences": ro.prompts_per_step * ro.group_size,
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
    """(the abstract policy `policy` in the rollout submesh's inference layout, the report's split keys): the
    rollout mesh and its device count, the policy bytes one rollout device holds, and the bytes each policy
    version moves from the learner's devices to the rollout devices (`reshard.transfer_bytes`)."""
    from posttrain.infra import reshard

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
    """Lowers and compiles the rollout engine's two programs (`engine_ops.decode_chunk` over `settings.num_slots`
    slots, K = `settings.chunk_steps` of the mesh's platform decode steps, and `engine_ops.prefill` of a
    `prompt_len`-token prompt) on `mesh`'s one device with the policy's
    abstract states and the page pool as `kv_pages.pool_shapes` makes it (`settings`: `engine.EngineSettings`).
    Attention: on a TPU mesh the engine's (`paged_attention.resolve_impl("auto", "tpu")`: the Pallas kernel where
    it takes the shapes, which also writes the pool in place: XLA:TPU copies a pool its scatters write more than
    once, `page_writes`), elsewhere the reference (a gather of each slot's pages; the GPU kernel reads the pool
    in place, so its temp is at most the reference's). Returns (the larger program's MemoryReport, compile
    seconds of both, the pool's bytes)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from posttrain.generate.engine import ops as engine_ops
    from posttrain.generate import kv_pages
    from posttrain.generate.engine.loop import Request, request_rows
    from posttrain.generate.paged_attention import resolve_impl

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
    """The `sample_*` keys of `plan_report`: the rollout sampler compiled for one step's prompts; with the rollout
    engine (`sampling.backend="engine"`), its decode step and prefill (`compile_engine`) sized as the run sizes
    it for a first turn's prompt_len + max_new_tokens tokens, and `sample_kv_pool_gib`, its page pool."""
    from posttrain.generate.sampler import shrink_schedule

    ro = plan.rollout
    if ro.engine is not None:
        settings = ro.engine.engine_settings(prompt_len + ro.sampling.max_new_tokens)
        srep, sseconds, pool = compile_engine(graphdef, model_state, mesh, settings, prompt_len=prompt_len)
        sd = srep.as_dict()
        return {"sample_backend": "engine", "sample_peak_gib": sd["peak_gib"], "sample_temp_gib": sd["temp_gib"],
                "sample_kv_pool_gib": pool / aot.GIB, "sample_compile_s": round(sseconds, 1),
                "sample_fits": aot.fits(srep.peak, hbm)}
    samples = ro.prompts_per_step * ro.group_size
    srep, sseconds = compile_sampler(graphdef, model_state, mesh, plan.rules, prompts=ro.prompts_per_step,
                                     prompt_len=prompt_len, group_size=ro.group_size, params=ro.sampling,
                                     shrink=shrink_schedule(samples, ro.decode_multiple, steps=ro.decode_shrink_steps),
                                     record_routing=ro.record_routing)
    sd = srep.as_dict()
    return {"sample_backend": "dense", "sample_peak_gib": sd["peak_gib"], "sample_temp_gib": sd["temp_gib"],
            "sample_compile_s": round(sseconds, 1), "sample_fits": aot.fits(srep.peak, hbm)}


def fit_verdict(report: dict, target: str) -> str:
    """The line for a plan that does not fit: every program over the limit (the train step `peak_gib`, the sampler
    `sample_peak_gib` when `sample_fits` is False), the largest (the decisive one) first."""
    limit = aot.HBM_FIT_FRACTION * report["hbm_gib"]
    over = [(p, name) for name, p, ok in (("train step", report["peak_gib"], report["peak_gib"] <= limit),
                                          ("sampler", report.get("sample_peak_gib"), report.get("sample_fits")))
            if ok is False]
    parts = [f"{name} peak {peak:.1f} GiB" for peak, name in sorted(over, reverse=True)]
    return (f"does not fit: {' and '.join(parts) or 'the plan'} per device > {aot.HBM_FIT_FRACTION:.0%} of "
            f"{report['hbm_gib']:.1f} GiB HBM on {target}")
