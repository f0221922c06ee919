"""The job scheduler's whole state round-trips through JSON and a resumed scheduler continues exactly
(docs/design.md invariant 9); the pass-rate band skips all-correct / all-wrong tasks, with re-checks, and reports
the fraction."""
import json

import pytest

from scheduler_fakes import FakeRunner, Source
from posttrain.scheduling import stats
from posttrain.scheduling.scheduler import JobScheduler
from posttrain.scheduling.domain_rules import DomainPolicy, SchedulerSettings
from posttrain.scheduling.tickets import Outcome

SETTINGS = SchedulerSettings(group_size=3, retries_per_step=1, max_attempts=2, breaker_window=12, breaker_rate=0.7,
                             breaker_cooldown_steps=3, band_visits=2, band_recheck=0.2, seed=5,
                             policies=(("code", DomainPolicy(priority=1, max_share=0.5, max_env_cpu_s=4.0)),
                                       ("m*", DomainPolicy(min_share=0.25))))
COSTS = {"code": 0.5, "math": 0.02}
INFRA = {"code": 0.2, "math": 0.3, "broken": 1.0}


def band_prob(domain, index, sample):
    """Tasks 0-2 always pass, 3-5 always fail, the rest split their samples."""
    return 1.0 if index < 3 else 0.0 if index < 6 else float(sample % 2)


def make():
    sources = {"code": Source(7, "c"), "math": Source(9, "m"), "broken": Source(4, "b"), "logic": Source(5, "l")}
    sched = JobScheduler(sources, SETTINGS, weights={"code": 1.0, "math": 2.0, "broken": 1.0, "logic": 1.0})
    return sched, FakeRunner(sched, costs=COSTS, infra=INFRA, pass_prob=band_prob, seed=2)


def fingerprint(logs):
    return [[(t.ticket_id, t.domain, t.task_index, t.visit, t.samples, t.attempt, t.try_index, t.retry_round, t.probe)
             for t in log.tickets] + [(g.group_key, g.fate, g.attempts, g.rewards) for g in log.complete + log.dropped]
            for log in logs]


def test_state_round_trips_and_a_resumed_scheduler_continues_exactly():
    a, run_a = make()
    run_a.run(25, 6)
    state = a.state_dict()
    assert json.loads(json.dumps(state)) == state
    b, run_b = make()
    b.load_state_dict(json.loads(json.dumps(state)))
    assert b.state_dict() == state
    assert state["domains"]["broken"]["breaker"]["state"] != "closed" and state["domains"]["code"]["cost"] == 0.5
    domains = state["domains"].values()
    assert any(d["quarantine"] for d in domains) and any(d["requeue"] for d in domains)
    assert fingerprint(run_a.run(20, 6, start=25)) == fingerprint(run_b.run(20, 6, start=25))
    assert a.state_dict() == b.state_dict() and a.metrics() == b.metrics()


def test_load_rejects_another_run_shape():
    a, run_a = make()
    run_a.run(2, 6)
    state = a.state_dict()
    other = JobScheduler({"code": Source(7, "c")}, SchedulerSettings(group_size=3, seed=5))
    with pytest.raises(ValueError, match="domains"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        JobScheduler({"code": Source(7, "c")}, SchedulerSettings(group_size=3, seed=6)).load_state_dict(state)
    small = {"code": Source(2, "c"), "math": Source(9, "m"), "broken": Source(4, "b"), "logic": Source(5, "l")}
    with pytest.raises(ValueError, match="outside"):
        JobScheduler(small, SETTINGS).load_state_dict(state)


def test_the_band_skips_settled_tasks_and_reports_the_skipped_fraction():
    s = SchedulerSettings(group_size=4, band_visits=2, band_recheck=0.1, seed=0)
    sched = JobScheduler({"m": Source(12, "m")}, s)
    runner = FakeRunner(sched, pass_prob=band_prob)
    warm = runner.run(6, 4)  # two passes: every task visited twice
    drawn = [t.task_index for log in runner.run(30, 4, start=6) for t in log.tickets]
    settled = sum(i < 6 for i in drawn)
    assert all(t.task_index in range(12) for log in warm for t in log.tickets)
    assert 0 < settled < 0.15 * len(drawn)  # only re-checks (10%) reach the settled half
    entry = sched.domains["m"].tasks[0]
    assert entry[1] >= 2 and entry[2] == 1.0 and entry[4] >= 2  # visits, mean reward, streak of all-correct
    assert sched.domains["m"].tasks[3][4] <= -2 and sched.domains["m"].tasks[7][4] == 0
    m = sched.metrics()
    assert 0.3 < m["tasks/skipped_frac"] == m["tasks/m/skipped_frac"] < 0.6
    off = JobScheduler({"m": Source(12, "m")}, SchedulerSettings(group_size=4, seed=0))
    off_runner = FakeRunner(off, pass_prob=band_prob)
    off_runner.run(36, 4)
    assert off.metrics()["tasks/skipped_frac"] == 0.0


@pytest.mark.parametrize("fail_visits, failed_share", [(-1, (0.0, 0.1)), (0, (0.25, 0.45)), (3, (0.0, 0.1))])
def test_the_band_sides_all_correct_and_all_wrong(fail_visits, failed_share):
    """band_fail_visits: -1 the band's count on both sides, 0 all-wrong tasks are never skipped (the failing
    quarter of the tasks then takes its share of draws and more, as the passing quarter is skipped), 3 they are
    after three all-wrong visits. The passing side is skipped as before in every case."""
    s = SchedulerSettings(group_size=4, band_visits=2, band_fail_visits=fail_visits, band_recheck=0.1, seed=0)
    sched = JobScheduler({"m": Source(12, "m")}, s)
    runner = FakeRunner(sched, pass_prob=band_prob)
    runner.run(9, 4)  # three passes
    drawn = [t.task_index for log in runner.run(30, 4, start=9) for t in log.tickets]
    passing, failing = (sum(lo <= i < lo + 3 for i in drawn) / len(drawn) for lo in (0, 3))
    assert passing < 0.1 and failed_share[0] <= failing <= failed_share[1], (passing, failing)
    assert [stats.in_band([0, 0, 0.0, 0, streak], 2, fail_visits) for streak in (2, 1, -1, -2, -3)] == \
        {-1: [True, False, False, True, True], 0: [True, False, False, False, False],
         3: [True, False, False, False, True]}[fail_visits]


def test_a_curriculum_move_restarts_the_band_but_not_the_visit_numbers():
    sched = JobScheduler({"m": Source(3, "m")}, SchedulerSettings(group_size=2, band_visits=1))
    (t,) = sched.next_tasks(0, 1)
    sched.report([Outcome(t.ticket_id, s, "ok", 1.0) for s in (0, 1)])
    assert sched.domains["m"].tasks[t.task_index][4] == 1
    sched.set_source("m", Source(3, "level2"))
    assert sched.domains["m"].tasks[t.task_index] == [1, 0, 0.0, -1, 0]
    with pytest.raises(ValueError, match="tasks"):
        sched.set_source("m", Source(4, "m"))
