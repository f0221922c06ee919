"""`posttrain plan` on fake CPU devices (its per-device numbers against a real sharded init), target parsing, the
plan configs, and the launch scripts' dry runs."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from posttrain.recipes import plan
from helpers import fake_devices_flags
ROOT = pathlib.Path(__file__).resolve().parents[3]


def _run(args, env_extra=None, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env_extra or {}))
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_plan_cli_on_eight_fake_cpu_devices():
    cmd = [sys.executable, "-m", "posttrain.cli", "plan", "--config=configs/tiny.py", "--target=cpu-8", "--json",
           "--prompt_len=16"]
    r = _run(cmd)  # tiny.py has 4 prompts per step: they do not split over 8 devices
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: the 4 rows of a step")
    r = _run(cmd + ["--config.rl.prompts_per_step=8"])
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8 and out["mesh"]["fsdp"] == 8 and out["fits"] is True
    assert out["rows"] % 8 == 0 and out["peak_gib"] > 0 and out["compile_s"] > 0 and out["flops_per_step"] > 0
    assert out["largest_buffers"] and out["involuntary_remat"] is False
    assert out["collective_gib"]["all-gather"] > 0  # FSDP gathers the weights
    assert out["sample_peak_gib"] > 0 and out["sample_compile_s"] > 0 and out["sample_fits"] is True
    # LoRA: the trainable params are small replicated adapters; the sharding check covers the whole model
    r = _run(cmd + ["--config.rl.prompts_per_step=8", "--config.lora.rank=4", "--nosampler"])
    assert r.returncode == 0, r.stderr[-2000:]
    lora = json.loads(r.stdout.strip().splitlines()[-1])
    assert lora["lora_rank"] == 4 and lora["fits"] is True and "sample_peak_gib" not in lora
    assert lora["optimizer_gib"] < out["optimizer_gib"]  # Adam moments of the adapters only


def test_collective_bytes_count_each_scanned_layer():
    """A 10-layer scan with weights split over 8 devices: each layer all-gathers its [64, 64] float32 weight in
    the forward and again in the backward, and all-reduces its weight gradient: 20 and 10 x 16 KiB."""
    script = textwrap.dedent("""
        import json, jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from posttrain.infra import aot
        mesh = jax.make_mesh((8,), ("fsdp",))
        def loss(w, x):
            y, _ = jax.lax.scan(lambda c, wl: (jnp.tanh(c @ wl), None), x, w)
            return y.sum()
        w = jax.ShapeDtypeStruct((10, 64, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp", None)))
        x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None)))
        print(json.dumps(aot.collective_bytes(jax.jit(jax.grad(loss)).lower(w, x).compile().as_text())))
    """)
    r = _run([sys.executable, "-c", script], {"XLA_FLAGS": fake_devices_flags(8)})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    layer = 64 * 64 * 4
    assert got["all-gather"] == 20 * layer and got["all-reduce"] + got["reduce-scatter"] == 10 * layer, got
    assert got["total"] == 30 * layer and got["unknown_trip_count_loops"] == 0


def test_collective_bytes_parse_async_and_nested_loops():
    """Hand-written HLO: an async all-gather (its start's result tuple holds the operand), a reduce-scatter in a
    loop of 3 nested in a loop of 4 (x12), and a loop without a trip count (counted once, reported) holding an
    all-reduce and a ragged all-to-all."""
    hlo = textwrap.dedent("""
        %inner (p: (s32[], f32[8])) -> (s32[], f32[8]) {
          %p = (s32[], f32[8]) parameter(0)
          %x = f32[8]{0} get-tuple-element(%p), index=1
          %rs = f32[2]{0} reduce-scatter(%x), dimensions={0}, to_apply=%add
          ROOT %t = (s32[], f32[8]) tuple(%i, %x)
        }

        %outer (q: (s32[], f32[8])) -> (s32[], f32[8]) {
          %q = (s32[], f32[8]) parameter(0)
          %w = (s32[], f32[8]) while(%q), condition=%c, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
          ROOT %r = (s32[], f32[8]) tuple(%i, %x)
        }

        %unknown (u: (s32[], bf16[4])) -> (s32[], bf16[4]) {
          %u = (s32[], bf16[4]) parameter(0)
          %v = bf16[4]{0} get-tuple-element(%u), index=1
          %ar = bf16[4]{0} all-reduce(%v), to_apply=%add
          %off = s64[2]{0} constant({0, 2})
          %out = bf16[8]{0} broadcast(%zero), dimensions={}
          %ra = bf16[8]{0} ragged-all-to-all(%v, %out, %off, %off, %off, %off)
          ROOT %t2 = (s32[], bf16[4]) tuple(%i, %v)
        }

        ENTRY %main (a: f32[4,16]) -> f32[16,16] {
          %a = f32[4,16]{1,0} parameter(0)
          %ags = (f32[4,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%a), dimensions={0}
          %agd = f32[16,16]{1,0} all-gather-done(%ags)
          %w1 = (s32[], f32[8]) while(%init), condition=%c, body=%outer, backend_config={"known_trip_count":{"n":"4"}}
          %w2 = (s32[], bf16[4]) while(%init2), condition=%c, body=%unknown
          ROOT %o = f32[16,16]{1,0} copy(%agd)
        }
    """)
    from posttrain.infra import aot
    got = aot.collective_bytes(hlo)
    assert got["all-gather"] == 16 * 16 * 4 and got["reduce-scatter"] == 12 * 8 * 4 and got["all-reduce"] == 4 * 2
    assert got["ragged-all-to-all"] == 4 * 2  # its input, not the output buffer or the offsets
    assert got["unknown_trip_count_loops"] == 1 and got["total"] == 1024 + 384 + 8 + 8


def test_planned_bytes_match_a_real_sharded_init():
    """Parameters, optimizer state and frozen state one device holds: the plan's figures (from abstract shapes and
    shardings) against what a real sharded init of the tiny MoE allocates on device 0 (expert-parallel mesh)."""
    script = textwrap.dedent("""
        import json, jax
        from flax import nnx
        from posttrain.learn import optim
        from posttrain.recipes import plan
        from posttrain.algos.grpo import step as ts, losses
        from posttrain.learn.state import create_train_state
        from posttrain.infra import mesh as mesh_lib
        from posttrain.model.presets import get_preset
        from posttrain.model.transformer import Transformer
        from posttrain.infra.partitioning import create_sharded
        cfg = get_preset("tiny-deepseek", vocab_size=320)
        mesh = mesh_lib.make_mesh({"fsdp": -1, "expert": 2})
        opts = ts.StepOptions(loss=losses.LossConfig(beta=0.1), temperature=1.0)
        opt = optim.make_optimizer("adamw", lr=1e-3, schedule="constant")
        _, abstract, _ = plan.abstract_train_state(cfg, opt.tx, mesh, need_reference=True)
        planned = plan.per_device_bytes((abstract.params, abstract.opt_state, abstract.frozen, abstract.ref_params))
        graphdef, model_state = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
        with jax.set_mesh(mesh):
            _, state = create_train_state(graphdef, model_state, opt.tx, jax.random.key(0), lora_rank=opts.lora_rank, need_reference=True)
        dev0 = jax.devices()[0]
        real = sum(s.data.nbytes for leaf in jax.tree.leaves((state.params, state.opt_state, state.frozen, state.ref_params))
                   for s in leaf.addressable_shards if s.device == dev0)
        total = sum(leaf.nbytes for leaf in jax.tree.leaves((state.params, state.opt_state, state.frozen, state.ref_params)))
        print(json.dumps({"planned": planned, "real": real, "total": total}))
    """)
    r = _run([sys.executable, "-c", script], {"XLA_FLAGS": fake_devices_flags(8)})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["real"] < got["total"] / 2  # really sharded
    assert abs(got["planned"] - got["real"]) <= 0.10 * got["real"], got


@pytest.mark.parametrize("target,match", [("v5p-3", "TensorCores"), ("tpu-8", "unknown target"),
                                          ("cpu-64", "xla_force_host_platform_device_count=64"),
                                          ("h200x12", "multiple of 8"), ("cpu-x", "expected cpu-N"),
                                          ("v5e-2", r"v5e-N counts chips; supported N: \[1, 4, 8,"),
                                          ("v6e-512", r"v6e-N counts chips; supported N: .*, 256\]"),
                                          ("v6e-0", "v5e-N, v6e-N or h200xN")])
def test_bad_targets_raise_clear_errors(target, match):
    with pytest.raises(ValueError, match=match):
        plan.target_devices(target)


def _libtpu_python():
    """An interpreter with libtpu (the `tpu` extra): this one, else the checkout's .venv-tpu (git-ignored; made by
    `VENV=.venv-tpu scripts/setup_env.sh tpu`), else None."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None:
        return sys.executable
    venv = ROOT / ".venv-tpu" / "bin" / "python"
    return str(venv) if venv.exists() else None


@pytest.mark.skipif(_libtpu_python() is None, reason="needs libtpu: VENV=.venv-tpu scripts/setup_env.sh tpu")
def test_plan_for_a_colab_tpu_compiles_on_the_cpu():
    """v5e-1, Colab's TPU runtime: libtpu compiles the tiny config's train step for one 16 GiB chip on this CPU,
    under the TPU precision policy (bf16 compute, float32 master weights), the step time at 197 TFLOP/s."""
    cmd = [_libtpu_python(), "-m", "posttrain.cli", "plan", "--config=configs/tiny.py", "--target=v5e-1", "--json",
           "--prompt_len=16", "--nosampler"]
    r = _run(cmd, {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})  # libtpu's lockfile would refuse a second process
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["target"], out["devices"], out["hbm_gib"]) == ("v5e-1", 1, 16.0)
    assert (out["compute_dtype"], out["param_dtype"]) == ("bfloat16", "float32")
    assert out["fits"] is True and 0 < out["peak_gib"] < 0.1 and out["compile_s"] > 0
    assert out["step_s_estimate"] == pytest.approx(out["flops_per_step"] / 197e12)
    assert out["collective_gib"] == {}  # one chip: nothing to exchange


def test_plan_configs_have_full_and_lora_variants():
    import importlib.util

    from posttrain.config import ConfigError, from_config_dict

    for name in ("kimi_k2", "deepseek_v3", "qwen3_30b_a3b"):
        spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / "plan" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        full, lora = from_config_dict(module.get_config()), from_config_dict(module.get_config("lora"))
        assert full.model.param_dtype == "float32" and full.lora.rank == 0 and full.model.preset
        assert lora.lora.rank > 0 and lora.model.param_dtype == "bfloat16"
        assert full.rl.prompts_per_step * full.rl.group_size == 256
        with pytest.raises(ConfigError, match="variant"):
            module.get_config("qlora")


def test_launch_scripts_dry_run_print_the_commands():
    tpu = _run(["bash", "launch/tpu_pod.sh", "--dry-run", "--config=configs/plan/kimi_k2.py", "--config.mesh.expert=16"],
               {"TPU_NAME": "my-v5p", "ZONE": "us-east5-a"})
    assert tpu.returncode == 0, tpu.stderr
    line = tpu.stdout.strip()
    assert line.startswith("gcloud compute tpus tpu-vm ssh my-v5p --zone=us-east5-a") and "--worker=all" in line
    assert "posttrain\\ train\\ --distributed" in line and "--config.mesh.expert=16" in line
    slurm = _run(["bash", "launch/slurm_gpu.sbatch", "--dry-run", "--config=configs/plan/deepseek_v3.py"])
    assert slurm.returncode == 0, slurm.stderr
    assert slurm.stdout.strip() == ("srun --kill-on-bad-exit=1 .venv/bin/posttrain train --distributed --noprogress "
                                    "--config=configs/plan/deepseek_v3.py")


def test_plan_of_the_engine_backend_compiles_its_programs_and_sizes_its_page_pool(tmp_path):
    """sampling.backend="engine": the plan compiles the rollout engine's decode step and prefill (not the dense
    sampler), for the engine the run would build: S = P * G slots, pages of 8 tokens, as many as every slot at its
    longest (prompt_len 16 + 6 new tokens -> 32 tokens, 4 pages) plus the scratch page. Its page pool, one K and
    one V array [L, K, P, Z, H] in the compute dtype, is an argument of both programs, so the peak holds it."""
    import numpy as np

    from helpers import tiny_config
    from posttrain.infra.aot import GIB

    engine = plan.plan_train_step(tiny_config(tmp_path, **{"sampling.backend": "engine",
                                                           "sampling.engine_page_size": 8}), "cpu-1", prompt_len=16)
    dense = plan.plan_train_step(tiny_config(tmp_path, **{"sampling.backend": "dense"}), "cpu-1", prompt_len=16)
    assert (engine["sample_backend"], dense["sample_backend"]) == ("engine", "dense")
    assert "sample_kv_pool_gib" not in dense and engine["sample_fits"] is True and engine["sample_compile_s"] > 0
    slots = engine["sequences"]
    pages = slots * 4 + 1
    L, K, H = 2, 2, 16  # tiny-dense: 2 layers, 2 KV heads of 16
    pool = 2 * L * K * pages * 8 * H * np.dtype(engine["compute_dtype"]).itemsize
    assert engine["sample_kv_pool_gib"] * GIB == pytest.approx(pool)
    assert engine["sample_peak_gib"] * GIB >= pool
    assert engine["peak_gib"] == dense["peak_gib"]  # the train step is the same program
