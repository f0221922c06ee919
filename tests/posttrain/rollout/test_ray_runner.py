"""RayEnvRunner under the job scheduler's tickets (issue 23 item 8), on a local Ray (marked `ray`, skipped without
it): an actor killed mid-step is restarted by Ray, its sample comes back as an infra error, the scheduler retries it
in the step, the group completes with all G samples scored, and the archive holds exactly one extra attempt. The
actor's own bookkeeping (an episode whose env state died with its actor, env errors) runs in-process, without Ray."""
import pathlib
import sys

import pytest

from posttrain.rollout.episodes import Sample
from posttrain.rollout.ray_runner import EnvHostActor, RayEnvRunner
from posttrain.rollout.tickets import StepDraw
from posttrain.tasks import archive
from posttrain.tasks.jobs import JobScheduler
from posttrain.tasks.policy import SchedulerSettings

POOL_ENVS = pathlib.Path(__file__).resolve().parents[2] / "envs" / "pool"  # pool_test_envs: Echo-v0 ("crash" exits)
IMPORTS = ("envs", "pool_test_envs")
G, P, ACTORS = 2, 1, 2  # one episode per actor: a death takes no other result with it


class Source:
    num_tasks = 3

    def get_task(self, i):
        return {"id": str(i), "answer": "a", "turns": 1}


class Ep:
    """An `episodes.Episode` look-alike of the pool's Echo-v0 env."""

    def __init__(self, task, seed):
        self.env_id, self.env_kwargs, self.task, self.seed = "posttrain-test/Echo-v0", {}, task, seed


@pytest.fixture(scope="module")
def runner():
    ray = pytest.importorskip("ray", reason="RayEnvRunner needs the optional `ray` extra")
    sys.path.insert(0, str(POOL_ENVS))
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        r = RayEnvRunner(ACTORS, max_restarts=2, step_timeout_s=30.0, imports=IMPORTS)
        yield r
        r.close()
    finally:
        ray.shutdown()
        sys.path.remove(str(POOL_ENVS))


@pytest.mark.ray
def test_a_killed_actor_is_restarted_and_its_sample_is_one_extra_attempt(runner, tmp_path):
    sched = JobScheduler({"echo": Source()}, SchedulerSettings(group_size=G, backoff_s=0.0, run="ray"))
    pids = runner.pids()

    def run_fn(batch, size, call):  # the first run's last episode crashes its actor (os._exit inside env.step)
        episodes = [Ep(t.task, 1000 * call + i) for t in batch for i in range(size)]
        runner.reset(episodes)
        actions = ["a"] * len(episodes)
        if call == 0:
            actions[-1] = "crash"  # episode 1 of the reset, alone on actor 1
        results = runner.step(actions)
        samples = [Sample(domain=t.domain, group=k, prompt_ids=[1], reward=r[1], status=r[4].get("status", ""),
                          done=True, info=r[4]) for k, t in enumerate(batch) for r in results[k * size:(k + 1) * size]]
        return samples, {}

    draw = StepDraw(G, dynamic_sampling=False)
    draw.job_round(run_fn, sched.next_tasks(0, P), sched)
    samples, _, attempts = draw.finish(P, 1)
    assert len(draw.kept) == P and all(s.status == "ok" and s.reward == 1.0 for s in samples)  # every group whole
    failed = [a for a in attempts if a.result.status == "infra_error"]
    assert len(failed) == 1 and "ray actor died" in failed[0].result.info["reason"]
    assert len(attempts) == P * G + 1 and runner.deaths == 1 and runner.replaced == 0
    rows = [archive.ticket_row(a.ticket, a.sample, policy_version=0, status=a.result.status, reward=a.result.reward,
                               in_batch=a.in_batch) for a in attempts]
    archive.write_step(tmp_path, 0, rows)
    table = archive.read(tmp_path).to_pylist()
    retried = [r for r in table if r["attempt"] > 0]
    assert len(table) == P * G + 1 and len(retried) == 1
    assert retried[0]["episode_id"] == failed[0].ticket.episode_id(failed[0].sample) and retried[0]["retry_round"] == 1
    assert retried[0]["in_batch"] and retried[0]["status"] == "ok"
    assert [r["status"] for r in table if r["episode_id"] == retried[0]["episode_id"]] == ["infra_error", "ok"]
    new = runner.pids()  # Ray restarted the crashed actor: a new process in the same slot, the other untouched
    assert new[0] == pids[0] and new[1] != pids[1]
    runner.reset([Ep({"answer": "a", "turns": 1}, i) for i in range(2)])
    assert [r[1] for r in runner.step(["a", "a"])] == [1.0, 1.0]  # the restarted actor serves episodes again
    with pytest.raises(ValueError, match=r"episodes \[7\] are not in the last reset of 2"):
        runner.step(["a"], [7])


def test_the_actor_ends_lost_and_broken_episodes_as_infra_errors(monkeypatch):
    monkeypatch.syspath_prepend(str(POOL_ENVS))
    actor = EnvHostActor(IMPORTS, [])
    assert actor.reset(0, "posttrain-test/Echo-v0", {}, {"answer": "a", "turns": 2}, 5)[1]["status"] == "ok"
    assert actor.step(0, "a")[1:4] == (1.0, False, False)
    restarted = EnvHostActor(IMPORTS, [])  # what Ray's restart leaves: a fresh actor that never saw slot 0
    assert restarted.step(0, "a") == ("", 0.0, False, True, {"status": "infra_error", "reason": "the episode's env "
                                                             "state was lost (its Ray actor restarted)"})
    _, reward, _, truncated, info = actor.step(0, "raise")
    assert (reward, truncated, info["status"]) == (0.0, True, "infra_error")
    assert "RuntimeError: env bug" in info["reason"]
    assert actor.step(0, "a")[4]["status"] == "infra_error"  # the broken episode is over
    info = actor.reset(1, "posttrain-test/Nope-v0", {}, {}, 0)[1]
    assert info["status"] == "infra_error" and info["reason"].startswith("env reset raised")
    with pytest.raises(ValueError, match="num_actors >= 1"):
        RayEnvRunner(0)
