"""`bench/rollout.py --aot cpu --quick` (docs/design.md invariant 16): the engine's decode step compiled ahead of time
through the same path as --aot h200 / v5p, on this machine's CPU; its memory figures are the compiled program's."""
import pathlib
from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_aot_quick_mode_reports_the_decode_steps_memory():
    bench = load_script(ROOT / "bench" / "rollout.py", "bench_rollout")
    out = bench.main(["--aot", "cpu", "--quick"])
    # tiny-dense: 2 layers x (k, v) x 2 kv heads x 17 pages (4 slots x 4 pages of 8 + scratch) x 8 x 16 dims, f32
    assert out["num_pages"] == 4 * 4 + 1 and out["attention_impl"] == "reference"
    assert out["pool_bytes"] == 2 * 2 * 2 * 17 * 8 * 16 * 4
    gib = out["pool_bytes"] / 2 ** 30
    assert abs(out["alias_gib"] - gib) < 2e-6 and abs(out["output_gib"] - gib) < 1e-5  # the pool is donated
    assert out["argument_gib"] >= out["weights_gib"] + gib - 2e-6
    peak = out["argument_gib"] + out["output_gib"] + out["assigned_temp_gib"] - out["alias_gib"]
    assert abs(out["peak_gib"] - peak) < 1e-5 and out["temp_gib"] > 0 and out["compile_s"] > 0
