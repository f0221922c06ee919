"""`bench/rollout.py --multi_turn 3 --quick` (docs/design.md invariant 16): today's sampler turn by turn and the engine
per episode (whole page table, narrowed table, env overlapped) run the same 3-turn episodes, agree on every greedy
reply, and report their speeds and ratios."""
import pathlib
from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_multi_turn_quick_mode():
    bench = load_script(ROOT / "bench" / "rollout.py", "bench_rollout")
    out = bench.main(["--multi_turn", "3", "--quick"])
    assert out["agree"] == {"engine_full_table": 4, "engine": 4, "engine_overlap": 4}  # greedy: the same replies
    assert 4 * 3 * 2 <= out["generated_tokens"] <= 4 * 3 * 6 and out["max_seq_len"] == 8 + 3 * (6 + 3)
    for side in ("engine_full_table", "engine", "engine_overlap"):
        assert abs(out[f"ratio_{side}"] - out[f"{side}_tokens_per_s"] / out["sampler_tokens_per_s"]) < 1e-9
    assert abs(out["table_width_speedup"] - out["engine_tokens_per_s"] / out["engine_full_table_tokens_per_s"]) < 1e-9
    assert out["env_s_per_round"] == 4 * 3 * 0.005
