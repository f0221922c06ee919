"""`bench/rollout.py --lengths long_tail --quick` (docs/design.md invariant 16): the paged engine, today's sampler and
transformers' `generate` run the same long-tail requests (the first two at equal KV memory), agree on every greedy
reply, and report their speeds and the engine's pages at peak."""
import pathlib
from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_long_tail_quick_mode():
    bench = load_script(ROOT / "bench" / "rollout.py", "bench_rollout")
    out = bench.main(["--lengths", "long_tail", "--quick"])
    s = out["settings"]
    assert out["agree"] == s["requests"] == 12  # greedy: the same tokens on both sides
    assert out["generated_tokens"] == 11 * 4 + 1 * 32  # 10% of 12 rounds to one long reply of 8 x 4 tokens
    assert out["engine_tokens_per_s"] > 0 and out["sampler_tokens_per_s"] > 0
    assert abs(out["ratio"] - out["engine_tokens_per_s"] / out["sampler_tokens_per_s"]) < 1e-9
    # equal KV memory: the pool holds one sampler call's cache (4 rows x (16 + 32) tokens) plus the scratch page
    page_bytes = out["engine_kv_bytes"] / s["num_pages"]
    assert out["engine_kv_bytes"] - page_bytes == out["sampler_kv_bytes"]
    m = out["engine_metrics"]
    assert m["rollout/preemptions"] == 0 and m["rollout/decode_tokens"] == out["generated_tokens"] - 12
    assert m["rollout/prefill_tokens"] == 12 * 8
    assert out["agree_transformers"] == 12 and out["transformers_tokens_per_s"] > 0  # the peer: same weights
    assert abs(out["ratio_transformers"] - out["engine_tokens_per_s"] / out["transformers_tokens_per_s"]) < 1e-9
    peak = out["peak_pages"]
    assert peak["allocated"] == m["rollout/kv_pages_allocated"] and 1 <= peak["live_at_peak"] <= s["slots"]
    assert 0 <= peak["allocated_minus_used"] <= peak["live_at_peak"]  # <= one page per live sequence
    assert peak["max_waste_per_live_seq"] <= 1.0
