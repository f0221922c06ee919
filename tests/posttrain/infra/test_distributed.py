"""(~45 s; in the default run: the tests of the multi-process path, one two-process run shared.) Multi-process runs through `jax.distributed` (the multi-host code path of TPU pods and GPU clusters), on CPU:
two processes with two devices each train the tiny config and log the same metrics as one process with four
devices (same mesh shape, fsdp=4), only process 0 writes metrics files, and each process steps only its half of
the environment episodes (the printed summary's `env_episodes`)."""
import json
import os
import socket
import subprocess
import sys

import pytest
from helpers import fake_devices_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
KEYS = ("policy/loss", "optim/grad_norm", "reward/mean", "rollout/logp_diff_mean", "policy/entropy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(workdir, nproc: int, devices_per_proc: int, timeout=600, extra=()):
    port = _free_port()
    procs = []
    for i in range(nproc):
        env = dict(os.environ, JAX_PLATFORMS="cpu", POSTTRAIN_XLA_CACHE="0",
                   XLA_FLAGS=fake_devices_flags(devices_per_proc))
        args = [sys.executable, "-m", "posttrain.cli", "train", "--config=configs/tiny.py", f"--workdir={workdir}",
                "--noprogress", "--config.train.steps=2", "--config.eval.at_start=False", "--config.eval.at_end=False",
                *extra]
        if nproc > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(nproc),
                       JAX_PROCESS_ID=str(i))
            args.append("--distributed")
        procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            p.kill()
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return [r for r in rows if "policy/loss" in r], outs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process metrics, its stdout lines; two-process metrics, their stdout lines): trained once."""
    tmp = tmp_path_factory.mktemp("distributed")
    return _train(tmp / "single", 1, 4), _train(tmp / "multi", 2, 2)


def test_two_processes_match_one_process(runs):
    (single, _), (multi, outs) = runs
    assert len(single) == len(multi) == 2
    for a, b in zip(single, multi):
        for k in KEYS:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (k, a[k], b[k])
    # process 0 alone wrote the metrics (one row per step, not two) and printed the summary
    assert [r["step"] for r in multi] == [1, 2]
    assert all(json.loads(o.strip().splitlines()[-1])["end_step"] == 2 for o in outs)


def test_each_process_steps_half_of_the_episodes(runs):
    """2 steps x 4 prompts x 4 samples = 32 env episodes: one process steps all 32, each of two processes its 16
    (the results are exchanged, so both still train on all 32: see the test above)."""
    (_, single_outs), (_, multi_outs) = runs
    single = [json.loads(o.strip().splitlines()[-1])["env_episodes"] for o in single_outs]
    multi = [json.loads(o.strip().splitlines()[-1])["env_episodes"] for o in multi_outs]
    assert single == [32]
    assert multi == [16, 16] and sum(multi) == single[0]


@pytest.mark.slow
def test_two_processes_keep_one_job_scheduler_replica_each(tmp_path):
    """With tasks.enabled every process holds a replica of the job scheduler and is reported the gathered
    outcomes of all shares: two processes draw the same tickets and log the same tasks/* metrics as one, and
    process 0 writes the same episode archive (timings and the run's name aside)."""
    from posttrain.scheduling import archive

    jobs = ["--config.tasks.enabled=True"]
    (single, _), (multi, _) = _train(tmp_path / "one", 1, 4, extra=jobs), _train(tmp_path / "two", 2, 2, extra=jobs)
    for a, b in zip(single, multi):
        assert {k: v for k, v in a.items() if k.startswith("tasks/")} == {
            k: v for k, v in b.items() if k.startswith("tasks/")}
        for k in KEYS:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (k, a[k], b[k])
    rows = [[{**r, "episode_id": r["episode_id"].split(":", 1)[1]} for r in archive.read(
        tmp_path / w, columns=["episode_id", "attempt", "prompt", "in_batch", "status"]).to_pylist()]
        for w in ("one", "two")]
    assert rows[0] == rows[1] and len(rows[0]) == 2 * 16
