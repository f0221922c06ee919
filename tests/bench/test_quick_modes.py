"""Every benchmark's --quick mode (seconds, tiny shapes, the same code path) runs once, and its JSON has the figure,
the peer it is compared with, and their ratio.

The four benches of scripts/accelerator_check.py (attention, grpo_step, moe, rollout) are checked in
test_accelerator_check.py, on the JSON its --dry-run wrote (their --quick shapes plus the check's own flags): the
`accelerator_dry_run` fixture is per session and so per xdist worker, and a second file using it ran the whole dry
run again on the other worker. Benches that start their own processes (the two trainers of grpo_vs_trl, sft_vs_trl
and dpo_vs_trl) or need fake CPU devices set before JAX starts (moe_ep_memory) run as a subprocess; the others run
in this process (JAX, torch already imported).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import json_value, load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _async_rl(out):
    lat, s = out["latency"], out["settings"]
    assert s["quick"] and out["quickstart"] == {"skipped": "--quickstart-steps < 2"}
    assert lat["sync"]["staleness_max"] == 0 and lat["async"]["staleness_max"] <= 1  # the bound held
    assert len(lat["sync"]["steps_s"]) == len(lat["async"]["steps_s"]) == s["steps"]
    assert lat["sync"]["terms_s"]["env"] >= s["latency"] and lat["sync"]["terms_s"]["gen"] > 0  # each step waits
    gil = out["gil_stall"]
    assert out["bound"] >= 1 and gil["ratio"] == gil["thread"]["ratio"] > 0 and gil["core_part"] > 0
    for v in ("sleep", "thread", "process"):  # each producer variant made batches while the learner was timed
        assert gil[v]["batches"] >= 1 and len(gil[v]["updates_s"]) == s["gil_steps"] * s["gil_rounds"]
    assert gil["thread"]["worker_cpu_s_per_batch"] is not None and gil["sleep"]["worker_cpu_s_per_batch"] == 0


def _grpo_vs_trl(out):
    assert out["settings"]["quick"] and out["settings"]["same_prompts_checked"] is True
    assert len(out["posttrain_steps_s"]) == len(out["trl_steps_s"]) == 1 and out["trl_version"]


def _offline_vs_trl(out):
    s = out["settings"]
    assert s["quick"] and len(out["posttrain_steps_s"]) == len(out["trl_steps_s"]) == s["steps"] == 2
    assert out["trl_version"] and out["peak_memory_ratio"] > 0 and all(out["tokens_per_step"].values())
    assert s["trl"]["bf16"] is False and s["trl"]["precompute_ref_log_probs"] == (s["kind"] == "dpo")
    if s["kind"] == "sft":  # the same completion tokens trained on both sides (TRL counts one more: its EOS)
        assert abs(out["tokens_per_step"]["posttrain"][0] - out["tokens_per_step"]["trl"][0]) <= 2
    else:
        assert out["dpo_over_sft_step"] > 0 and out["sft_step_s_same_pairs"] > 0


def _moe_ep_memory(out):
    assert out["devices"] == "fake cpu" and set(out["temp_bytes"]) == {"all_to_all", "all_gather"}
    assert set(out["temp_bytes"]["all_to_all"]) == {"2", "4"}


def _sandbox(out):
    assert out["posttrain_passed"] == out["harness_passed"] == out["problems"] == 4


def _archive(out):
    assert out["quick"] and out["rows"] == 10_000 and out["domains_answered"] == 300 and out["step_rows"] == 64


def _verifiers(out):
    assert out["quick"] and out["timeout_call_status"] == "timeout" and set(out["shapes"]) >= {"spaces", "braces"}


# bench: (arguments, where it runs: "process" | "subprocess", figure, peer, ratio (keys, dotted), more checks)
TABLE = {
    "archive": ([], "process", "write_s_per_step", "quickstart_step_s", "write_ratio", _archive),
    "async_rl": ([], "process", "async_steps_per_hour", "sync_steps_per_hour", "ratio", _async_rl),
    "grpo_vs_trl": (["--steps", "2"], "subprocess", "posttrain_step_s", "trl_step_s", "ratio", _grpo_vs_trl),
    "dpo_vs_trl": ([], "subprocess", "posttrain_step_s", "trl_step_s", "ratio", _offline_vs_trl),
    "sft_vs_trl": ([], "subprocess", "posttrain_step_s", "trl_step_s", "ratio", _offline_vs_trl),
    "moe_ep_memory": ([], "subprocess", "temp_bytes.all_to_all.4", "temp_bytes.all_gather.4",
                      "ratio_to_all_gather.all_to_all.4", _moe_ep_memory),
    "sandbox": ([], "process", "posttrain_problems_per_s", "harness_problems_per_s", "ratio", _sandbox),
    "verifiers": ([], "process", "max_ms_1m", "goal_ms_1m", "ratio_to_goal", _verifiers),
}


DRY_RUN_BENCHES = {"attention", "grpo_step", "moe", "rollout"}  # test_accelerator_check.py checks their quick modes


def test_every_benchmark_has_a_quick_mode_here():
    assert {p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_")} == set(TABLE) | DRY_RUN_BENCHES


_OUTPUTS: dict = {}  # bench -> its quick JSON (each quick mode runs once per session)


def _run(name: str, capsys) -> dict:
    if name in _OUTPUTS:
        return _OUTPUTS[name]
    argv, where = ["--quick", "--json", *TABLE[name][0]], TABLE[name][1]
    if where == "process":
        _load(name).main(argv)
        stdout = capsys.readouterr().out
    else:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        r = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *argv], capture_output=True, text=True,
                           timeout=600, cwd=ROOT, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        stdout = r.stdout
    _OUTPUTS[name] = json.loads(stdout.strip().splitlines()[-1])
    return _OUTPUTS[name]


def _load(name: str):
    return load_script(BENCH / f"{name}.py", f"bench_{name}")


@pytest.mark.parametrize("name", sorted(TABLE))
def test_quick_mode_reports_the_figure_its_peer_and_their_ratio(name, capsys):
    _, _, figure, peer, ratio, check = TABLE[name]
    out = _run(name, capsys)
    values = [json_value(out, k) for k in (figure, peer, ratio)]
    assert all(isinstance(v, (int, float)) and v > 0 for v in values), dict(zip((figure, peer, ratio), values))
    check(out)

