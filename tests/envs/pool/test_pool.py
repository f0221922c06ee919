"""Tests for envs/pool.py (process backend; the ray backend's: tests/posttrain/rollout/test_ray_runner.py, one Ray
session for them and the config that selects it).

Test envs live in pool_test_envs.py (this directory), imported by the workers through `imports`.
"""
import collections
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from envs.pool.processes import EnvPool, EpisodeSpec, StepResult

sys.path.insert(0, str(Path(__file__).parent)) if str(Path(__file__).parent) not in sys.path else None
IMPORTS = ("envs", "pool_test_envs")
ECHO = "posttrain-test/Echo-v0"


def echo(n, turns=1, seed0=0):
    return [EpisodeSpec(env_id=ECHO, task={"answer": "a", "turns": turns}, seed=seed0 + i) for i in range(n)]


@pytest.fixture(scope="module")
def pool():
    with EnvPool(4, step_timeout_s=2.0, imports=IMPORTS) as p:
        yield p
    assert not any(psutil.pid_exists(pid) for pid in p.worker_pids if pid), "workers survived close()"


def test_multi_turn_episodes_sequence_and_mapping(pool):
    first = pool.reset(echo(6, turns=2))
    assert [info["status"] for _, info in first] == ["ok"] * 6 and pool.active == list(range(6))
    out = pool.step(["a", "b", "a", "a", "a", "a"])
    assert len(out) == 6 and all(isinstance(r, StepResult) for r in out)
    assert [r.reward for r in out] == [1, 0, 1, 1, 1, 1] and not any(r.terminated for r in out)
    out = pool.step({3: "b", 0: "a"})  # a subset: the others keep waiting
    assert out[0].terminated and (out[1].reward, out[1].info["status"]) == (0.0, "wrong")
    assert pool.active == [1, 2, 4, 5]
    out = pool.step(["a", "b"], indices=[5, 1])  # rollout.EnvRunner style
    assert [r.reward for r in out] == [1.0, 0.0] and pool.active == [2, 4]
    obs, reward, terminated, truncated, info = pool.step(["a"] * 2)[1]  # unpacks like gymnasium
    assert (reward, terminated, truncated) == (1.0, True, False) and pool.active == []


def test_bad_input_is_one_clear_error(pool):
    pool.reset(echo(2))
    with pytest.raises(ValueError, match="3 actions for 2 episodes"):
        pool.step(["a"] * 3)
    with pytest.raises(ValueError, match=r"episodes \[7\] are not active"):
        pool.step({7: "a"})
    with pytest.raises(ValueError, match="repeated"):
        pool.step(["a", "a"], indices=[0, 0])
    with pytest.raises(TypeError, match="must be str"):
        pool.step([1, "a"])
    with pytest.raises(TypeError, match="EpisodeSpec-like"):
        pool.reset([{"env_id": ECHO}])
    with pytest.raises(ValueError, match="env_id"):
        EpisodeSpec(env_id="")
    with pytest.raises(ValueError, match="num_workers"):
        EnvPool(0)
    with pytest.raises(ValueError, match="backend"):
        EnvPool(1, backend="threads")


def test_workers_do_not_import_jax_and_serve_registered_envs(pool):
    Episode = collections.namedtuple("Episode", "env_id env_kwargs task seed domain")  # a look-alike spec
    first = pool.reset([Episode("posttrain/Arithmetic-v0", {}, None, 7, "math")] * 2)
    assert first[0] == first[1] and "What is" in first[0][0]
    [wrong] = pool.step({0: "-1"})
    assert (wrong.reward, wrong.info["status"]) == (0.0, "wrong")
    [right] = pool.step({1: f"The answer is {wrong.info['gold']}."})
    assert (right.reward, right.info["status"]) == (1.0, "ok")
    assert [w.info["jax_imported"] for w in pool._workers] == [False] * 4


def test_hung_worker_is_killed_restarted_and_serves_the_next_batch(pool):
    pool.reset(echo(8))
    pids, restarts = pool.worker_pids, pool.restarts
    t0 = time.monotonic()
    out = pool.step(["a", "sleep:30"] + ["a"] * 6)  # episode 1 hangs in worker 1 (with episode 5)
    assert time.monotonic() - t0 < 10
    assert out[1].info == {"status": "infra_error", "reason": "worker timed out: step of episode 1 took longer than 2 s"}
    assert (out[1].reward, out[1].truncated) == (0.0, True)
    assert out[5].info["status"] == "infra_error" and "episode state lost" in out[5].info["reason"]
    assert [out[ep].reward for ep in (0, 2, 3, 4, 6, 7)] == [1.0] * 6
    new_pids = pool.worker_pids
    assert new_pids[1] != pids[1] and [new_pids[i] for i in (0, 2, 3)] == [pids[i] for i in (0, 2, 3)]
    assert pool.restarts == restarts + 1 and not psutil.pid_exists(pids[1])
    pool.reset(echo(8))
    assert [r.reward for r in pool.step(["a"] * 8)] == [1.0] * 8  # the new worker 1 serves


def test_crash_and_env_exception_are_infra_errors_not_wrong_answers(pool):
    pool.reset(echo(4))
    pids = pool.worker_pids
    out = pool.step(["crash", "raise", "a", "a"])
    assert (out[0].info["status"], out[0].info["reason"]) == ("infra_error", "worker process died (exit code 3)")
    assert out[1].info["status"] == "infra_error" and "RuntimeError: env bug" in out[1].info["reason"]
    assert [out[2].reward, out[3].reward] == [1.0, 1.0]
    assert pool.worker_pids[0] != pids[0] and pool.worker_pids[1:] == pids[1:]  # an env bug keeps its worker


def test_waiting_episodes_of_a_dead_worker_and_failed_resets_report_at_their_next_step(pool):
    first = pool.reset(echo(8, turns=2) + [EpisodeSpec(env_id="posttrain-test/NoSuchEnv-v0")])
    assert first[8][1]["status"] == "infra_error" and "NoSuchEnv" in first[8][1]["reason"]
    [crashed] = pool.step({0: "crash"})  # worker 0 also held episodes 4 and 8
    assert crashed.info["reason"] == "worker process died (exit code 3)" and pool.active == list(range(1, 9))
    out = pool.step(["a"] * 8)
    assert [r.info["status"] for r in out] == ["ok"] * 3 + ["infra_error"] + ["ok"] * 3 + ["infra_error"]
    assert "episode state lost" in out[3].info["reason"] and "NoSuchEnv" in out[7].info["reason"]
    assert pool.active == [1, 2, 3, 5, 6, 7]


def test_env_host_reuses_envs_and_a_reset_releases_the_previous_batch():
    import pool_test_envs  # noqa: F401  (registers Echo-v0 here too)
    from envs.pool.env_host import EnvHost

    host = EnvHost()
    for ep in range(4):
        assert host.handle("reset", (ep, ECHO, {}, None, ep))[0] == "ok"
    envs = {id(env) for _, env in host._live.values()}
    host.release_all()
    assert host.handle("reset", (0, ECHO, {}, None, 0))[0] == "ok"
    assert len(host._live) == 1 and id(host._live[0][1]) in envs and sum(map(len, host._free.values())) == 3
    kind, reason = host.handle("step", (5, "a"))
    assert kind == "error" and "episode 5 is not active" in reason
    host.close()


@pytest.mark.parametrize("action, reward", [("reward:'1.0'", "1.0"), ("reward:None", None), ("reward:[1]", [1]),
                                            ("reward:1j", 1j), ("reward:True", 1.0), ("reward:7", 7.0)])
def test_env_host_passes_a_reward_that_is_no_real_number_on_unchanged(action, reward):
    """The worker used to float() every reward ("1.0" scored 1, the pool and Ray backends alike): a real number is
    a float, anything else goes back as the env returned it, for the caller to refuse (posttrain's rollout)."""
    import pool_test_envs  # noqa: F401
    from envs.pool.env_host import EnvHost

    host = EnvHost()
    assert host.handle("reset", (0, ECHO, {}, {"answer": "a", "turns": 1}, 0))[0] == "ok"
    kind, (obs, got, terminated, truncated, info) = host.handle("step", (0, action))
    assert kind == "ok" and got == reward and type(got) is type(reward) and terminated and not truncated
    host.close()


def test_deterministic_seeds_give_identical_results_across_pools():
    specs = echo(10, turns=2, seed0=100)
    runs = []
    for workers in (2, 3):
        with EnvPool(workers, imports=IMPORTS) as p:
            runs.append((p.reset(specs), p.step(["a"] * 10), p.step(["b"] * 10)))
    assert runs[0] == runs[1]
    assert len({obs for obs, _ in runs[0][0]}) == 10  # different seeds, different draws


def test_256_episodes_with_10_percent_of_workers_killed_mid_step():
    n, killed = 256, (3, 7)
    with EnvPool(20, step_timeout_s=30.0, imports=IMPORTS) as p:
        p.reset(echo(n))
        pids = p.worker_pids
        actions = ["sleep:60" if ep in killed else "a" for ep in range(n)]  # workers 3, 7 busy on their first item

        def kill_them():
            time.sleep(1.0)
            for w in killed:
                os.kill(pids[w], signal.SIGKILL)

        killer = threading.Thread(target=kill_them)
        killer.start()
        t0 = time.monotonic()
        out = p.step(actions)
        killer.join()
        assert time.monotonic() - t0 < 20
        infra = {ep for ep, r in enumerate(out) if r.info["status"] == "infra_error"}
        assert len(out) == n and infra == {ep for ep in range(n) if ep % 20 in killed}
        assert all(out[ep].reward == 1.0 and out[ep].terminated for ep in range(n) if ep not in infra)
        assert all(out[ep].info["reason"] == "worker process died (killed by SIGKILL)" for ep in killed)
        assert p.restarts == 2 and p.infra_errors == len(infra) == 26
        p.reset(echo(n))
        assert [r.reward for r in p.step(["a"] * n)] == [1.0] * n
