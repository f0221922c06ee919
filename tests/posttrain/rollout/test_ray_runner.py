"""The Ray env runner (issue 23 item 8), on one local Ray session (ray is a dev dependency: nothing here skips).
`env.backend = "ray"` in a run's config builds the rollout phase's runner as an `EnvPool` of Ray actors (one
implementation, `envs.pool.ray_pool`). That backend has the process backend's API and results, with a hung actor
(killed past its timeout) and a dead one both Ray's restarts. Under the job scheduler's tickets an actor that dies
mid-step is Ray's restart (a new process in the same slot, no new actor), its sample comes back as an infra error,
the scheduler retries it in the step, the group completes with all G samples scored and the archive holds exactly
one extra attempt. The config's checks of the field run without Ray."""
import pathlib
import sys

import pytest
import ray

from envs.pool.processes import EnvPool, EpisodeSpec
from helpers import tiny_config
from posttrain.config import ConfigError
from posttrain.config.plan import make_run_plan
from posttrain.rollout.episodes import Sample
from posttrain.rollout.env_side import make_runner
from posttrain.rollout.attempts import StepDraw
from posttrain.scheduling import archive
from posttrain.scheduling.scheduler import JobScheduler
from posttrain.scheduling.domain_rules import SchedulerSettings

POOL_ENVS = pathlib.Path(__file__).resolve().parents[2] / "envs" / "pool"  # pool_test_envs: Echo-v0 ("crash" exits)
IMPORTS = ("envs", "pool_test_envs")
ECHO = "pool_test_envs:posttrain-test/Echo-v0"  # `module:id`: actors that import only `envs` (a run's) find it
G, P, ACTORS = 2, 1, 2  # one episode per actor: a death takes no other result with it


class Source:
    num_tasks = 3

    def get_task(self, i):
        return {"id": str(i), "answer": "a", "turns": 1}


class Ep:
    """An `episodes.Episode` look-alike of the pool's Echo-v0 env."""

    def __init__(self, task, seed):
        self.env_id, self.env_kwargs, self.task, self.seed = ECHO, {}, task, seed


def echo(n, seed0=0):
    return [EpisodeSpec(env_id=ECHO, task={"answer": "a", "turns": 1}, seed=seed0 + i) for i in range(n)]


@pytest.fixture(scope="module")
def ray_session():
    sys.path.insert(0, str(POOL_ENVS))  # the actors import what the driver can (its sys.path)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
        sys.path.remove(str(POOL_ENVS))


@pytest.mark.ray
def test_ray_backend_same_api_with_dead_and_hung_actors(ray_session):
    with EnvPool(3, step_timeout_s=3.0, backend="ray", imports=IMPORTS) as p:
        first = p.reset(echo(9, seed0=100))
        with EnvPool(2, imports=IMPORTS) as reference:  # same seeds, same draws as the process backend
            assert first == reference.reset(echo(9, seed0=100))
        out = p.step(["a", "sleep:30", "crash"] + ["a"] * 6)
        assert out[1].info["reason"] == "worker timed out: step of episode 1 took longer than 3 s"
        assert out[2].info["status"] == "infra_error" and out[2].info["reason"].startswith("ray actor died")
        assert {ep for ep, r in enumerate(out) if r.info["status"] == "infra_error"} == {1, 2, 4, 5, 7, 8}
        assert [out[ep].reward for ep in (0, 3, 6)] == [1.0] * 3 and p.restarts == 2
        pids = p.worker_pids
        p.reset(echo(9))
        assert [r.reward for r in p.step(["a"] * 9)] == [1.0] * 9
        new = p.worker_pids  # the hung and the dead actor: Ray's restarts (new processes), not new actors
        assert new[0] == pids[0] and None not in new[1:] and p._backend.replaced == 0


@pytest.fixture(scope="module")
def runner(ray_session, tmp_path_factory):
    """The runner a config with env.backend='ray' and env.num_workers=2 builds (`make_runner` of its run plan's
    rollout settings, as `Rollouter.build` calls it)."""
    plan = make_run_plan(tiny_config(tmp_path_factory.mktemp("ray"), **{"env.backend": "ray",
                                                                          "env.num_workers": ACTORS}))
    env = plan.rollout_settings.env_config
    assert (env.backend, env.num_workers) == ("ray", ACTORS)
    r = make_runner(env.num_workers, env.step_timeout_s, env.backend)
    yield r
    r.close()


@pytest.mark.ray
def test_the_config_builds_a_ray_pool_and_a_killed_actor_is_one_extra_attempt(runner, tmp_path):
    assert isinstance(runner, EnvPool) and runner.backend == "ray" and runner.num_workers == ACTORS
    sched = JobScheduler({"echo": Source()}, SchedulerSettings(group_size=G, backoff_s=0.0, run="ray"))
    runner.reset([Ep({"answer": "a", "turns": 1}, i) for i in range(ACTORS)])  # every actor up: its pid known
    pids = runner.worker_pids
    assert None not in pids

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
    draw.round(run_fn, sched.next_tasks(0, P), sched)
    samples, _, attempts = draw.finish(P, 1)
    assert len(draw.kept) == P and all(s.status == "ok" and s.reward == 1.0 for s in samples)  # every group whole
    failed = [a for a in attempts if a.result.status == "infra_error"]
    assert len(failed) == 1 and "ray actor died" in failed[0].result.info["reason"]
    assert len(attempts) == P * G + 1 and runner.restarts == 1
    assert runner._backend.replaced == 0  # the dead actor came back through Ray's restart, not as a new actor
    rows = [archive.ticket_row(a.ticket, a.sample, policy_version=0, status=a.result.status, reward=a.result.reward,
                               in_batch=a.in_batch) for a in attempts]
    archive.write_step(tmp_path, 0, rows)
    table = archive.read(tmp_path).to_pylist()
    retried = [r for r in table if r["attempt"] > 0]
    assert len(table) == P * G + 1 and len(retried) == 1
    assert retried[0]["episode_id"] == failed[0].ticket.episode_id(failed[0].sample) and retried[0]["retry_round"] == 1
    assert retried[0]["in_batch"] and retried[0]["status"] == "ok"
    assert [r["status"] for r in table if r["episode_id"] == retried[0]["episode_id"]] == ["infra_error", "ok"]
    runner.reset([Ep({"answer": "a", "turns": 1}, i) for i in range(2)])
    assert [r[1] for r in runner.step(["a", "a"])] == [1.0, 1.0]  # the restarted actor serves episodes again
    new = runner.worker_pids  # Ray restarted the crashed actor: a new process in the same slot, the other untouched
    assert new[0] == pids[0] and new[1] not in (None, pids[1]) and runner._backend.replaced == 0


@pytest.mark.parametrize("over, match", [
    ({"env.backend": "ray", "env.num_workers": 0}, r"env.backend='ray' needs env.num_workers >= 1 .*got "
                                                    r"env.num_workers=0"),
    ({"env.backend": "threads", "env.num_workers": 2}, r"env.backend='threads'; expected one of \('process', 'ray'\)"),
])
def test_bad_backends_are_config_errors(over, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config("/tmp/x", **over)
    with pytest.raises(ValueError, match="env backend 'ray' needs num_workers >= 1, got 0"):
        make_runner(0, 1.0, "ray")
