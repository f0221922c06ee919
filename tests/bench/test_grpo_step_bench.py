"""bench/grpo_step.py: its argument checks (--quick), the AOT error without the compiler plugin, the analytic FLOP
count against a hand count, and the XLA buffer report (its run mode end to end: tests/bench/test_quick_modes.py)."""
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.infra import aot

from posttrain.model import flops
from posttrain.rollout.batching import random_batch
from posttrain.model.presets import get_preset

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "grpo_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("grpo_step_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bad_arguments_stop_with_one_line(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "4"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "4", "--row-len", "100", "--prompt-len", "16", "--group-size", "8"])
    quick = bench.parse_args(["--quick", "--steps", "3"])
    assert (quick.model, quick.rows, quick.row_len, quick.steps) == ("tiny-dense", 2, 48, 3)  # given values win


def test_aot_without_the_compiler_plugin_names_the_install_command(bench):
    if bench.has_cuda_compiler_plugin():
        pytest.skip(reason="the aot extra is installed here")
    with pytest.raises(RuntimeError, match=r"scripts/setup_env.sh aot"):
        aot.target_devices("h200")
    with pytest.raises(ValueError, match="unknown AOT target"):
        aot.target_devices("a100")


def test_flops_match_a_hand_count():
    cfg = get_preset("tiny-dense")
    batch = random_batch(0, advantage_fn("grpo"), prompts=2, group_size=2, prompt_len=16, completion_len=16, vocab_size=cfg.vocab_size)
    f = flops.train_step_flops(cfg, flops.abstract_model_state(cfg), batch)
    D, F, N, K, H, V, L = (cfg.d_model, cfg.mlp_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size,
                           cfg.num_layers)
    per_layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F + 2 * D  # q, k, v, o, MLP, two norms
    active = L * per_layer + D  # + final norm; embedding (and the tied/untied head) excluded
    assert f.active_params == active
    tokens = 2 * (16 + 2 * 16)
    assert f.tokens == tokens and f.scored_tokens == 2 * 2 * 16
    assert f.matmul == 6 * active * tokens
    assert f.lm_head == 6 * D * V * 64
    prompt_pairs = sum(range(1, 17))
    completion_pairs = sum(16 + j + 1 for j in range(16))
    assert f.attention == 3 * 2 * 2 * H * N * L * 2 * (prompt_pairs + 2 * completion_pairs)


def test_buffer_report_names_the_largest_intermediate():
    def f(a):
        return jnp.sort(a @ a.T, axis=1)[:, :2]  # the [1024, 1024] float32 product must exist (4 MiB)

    x = jnp.ones((1024, 64), jnp.float32)
    _, report, seconds = aot.compile_with_report(jax.jit(f).lower(x))
    assert report.peak == report.argument + report.output + report.temp - report.alias and seconds > 0
    assert report.largest and report.largest[0][0] >= 1024 * 1024 * 4 and "1024,1024" in report.largest[0][1]
    assert all(a[0] >= b[0] for a, b in zip(report.largest, report.largest[1:]))
