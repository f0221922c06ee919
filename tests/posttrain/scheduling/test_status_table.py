"""The run view (issue 23 item 7): status.json snapshots of the job scheduler, counters from the archive, and the
rows `posttrain status` prints, as tables of cases; the archive's counters equal the scheduler's on a flaky run."""
import json
import os

import pytest

from scheduler_fakes import FakeRunner, Source
from posttrain.scheduling import archive, status_table
from posttrain.scheduling.scheduler import JobScheduler
from posttrain.scheduling.domain_rules import DomainPolicy, SchedulerSettings
from posttrain.scheduling.weighted_draw import WeightedDraw

G, P, STEPS = 2, 4, 12
SETTINGS = SchedulerSettings(group_size=G, retries_per_step=1, max_attempts=2, breaker_window=8, breaker_rate=0.75,
                             breaker_cooldown_steps=3, seed=3, run="v",
                             policies=(("code", DomainPolicy(priority=1, max_share=0.5, max_env_cpu_s=2.0)),))
INFRA = {"code": 0.2, "math": 0.3, "broken": 1.0}
COSTS = {"code": 0.25, "math": 0.0, "broken": 0.0}


def counters(**kw):
    return {**dict.fromkeys(status_table.COUNTERS, 0), **kw}


@pytest.fixture(scope="module")
def flaky(tmp_path_factory):
    sched = JobScheduler({n: Source(5, n) for n in INFRA}, SETTINGS)
    runner, workdir = FakeRunner(sched, costs=COSTS, infra=INFRA, seed=2), tmp_path_factory.mktemp("run")
    for k in range(STEPS):
        log = runner.step(k, P)
        archive.write_step(workdir, k, [archive.ticket_row(a.ticket, a.sample, policy_version=k, status=a.status,
                                                           reward=a.reward, env_cost_s=a.cost_s)
                                        for a in log.attempts])
        status_table.write_status(workdir, status_table.snapshot(k, sched, {"math": 2}))
    return sched, runner, workdir


def test_the_snapshot_holds_the_schedulers_policies_counters_quarantine_and_breaker(flaky):
    sched, _, workdir = flaky
    status = status_table.read_status(workdir)
    assert status["step"] == STEPS - 1 and status["steps"] == STEPS and status["scheduler"] == "jobs"
    code, broken = status["domains"]["code"], status["domains"]["broken"]
    assert (code["priority"], code["max_env_cpu_s"], code["level"]) == (1, 2.0, None)
    assert status["domains"]["math"]["level"] == 2
    assert broken["breaker"] in ("open", "probing") and broken["run"]["infra_errors"] == broken["run"]["episodes"] > 0
    for name, d in sched.domains.items():
        assert status["domains"][name]["run"] == {k: d.totals[k] for k in status_table.COUNTERS}
        assert status["domains"][name]["quarantined"] == len(d.quarantine)
    assert not list(workdir.glob(".status.json.*"))  # the temp file was renamed


def test_the_archive_gives_the_schedulers_counts(flaky):
    sched, runner, workdir = flaky
    stats = status_table.archive_stats(archive.read(workdir, columns=status_table.ARCHIVE_COLUMNS))
    assert stats["step"] == STEPS - 1 and stats["steps"] == STEPS
    for name, d in sched.domains.items():
        got = stats["domains"][name]["run"]
        for key in ("groups", "episodes", "infra_errors", "retries"):
            assert got[key] == d.totals[key], (name, key)
        assert got["slots"] == STEPS * P  # the archive: every group drawn
        # the scheduler: a domain's slots while it is drawn from (a paused one has fewer)
        assert d.totals["slots"] == STEPS * P if name != "broken" else d.totals["slots"] < STEPS * P
        assert got["cpu_s"] == pytest.approx(d.totals["cpu_s"])
        attempts = [a for log in runner.logs for a in log.attempts if a.ticket.domain == name]
        scored = [a for a in attempts if a.status != "infra_error"]  # every scored attempt, complete group or not
        assert (got["scored"], got["passes"]) == (len(scored), sum(a.reward >= 1 for a in scored))
    last = [a for a in runner.logs[-1].attempts if a.ticket.domain == "code"]
    assert stats["domains"]["code"]["last"]["episodes"] == len(last)
    m = sched.metrics()  # the step's scalars (metrics.jsonl, TensorBoard): tasks/<domain>/infra_errors among them
    assert m["tasks/code/infra_errors"] == stats["domains"]["code"]["last"]["infra_errors"] == \
        sum(a.status == "infra_error" for a in last)
    assert m["tasks/broken/quarantined"] == len(sched.domains["broken"].quarantine)
    from_status, from_archive = status_table.rows(status_table.read_status(workdir)), status_table.rows(None, stats)
    for a, b in zip(from_status, from_archive):
        assert (a["domain"], a["episodes"], a["infra_errors"], a["retries"]) == \
               (b["domain"], b["episodes"], b["infra_errors"], b["retries"])
        assert a["share_run"] == b["share_run"] if a["domain"] != "broken" else a["share_run"] > b["share_run"]


def test_snapshot_of_the_weighted_draw_has_its_probabilities_only():
    s = status_table.snapshot(4, WeightedDraw({"a": Source(3, "a"), "b": Source(3, "b")}, {"a": 3.0, "b": 1.0}))
    assert s["scheduler"] == "weighted" and s["domains"] == {"a": {"weight": 0.75, "priority": 0, "level": None},
                                                              "b": {"weight": 0.25, "priority": 0, "level": None}}


STATUS = {"steps": 4, "domains": {"a": {"weight": 2.0, "priority": 1, "max_env_cpu_s": 10.0, "quarantined": 1,
                                        "breaker": "open", "level": 3,
                                        "last": counters(groups=1, slots=4, cpu_s=5.0),
                                        "run": counters(groups=6, slots=16, cpu_s=30.0, episodes=12, scored=8,
                                                        passes=2, infra_errors=4, retries=3)}}}
ARCHIVE = {"steps": 2, "domains": {"a": {"last": counters(groups=1, slots=2), "run": counters(groups=3, slots=4,
                                                                                              episodes=9)},
                                   "b": {"last": counters(groups=1, slots=2, scored=2, passes=1),
                                         "run": counters(groups=1, slots=4, episodes=2, scored=2, passes=1)}}}
WEIGHTED = {"steps": 2, "domains": {"a": {"weight": 0.5, "priority": 0, "level": None},
                                    "b": {"weight": 0.5, "priority": 0, "level": 1}}}


@pytest.mark.parametrize("status, stats, domain, expected", [
    # the snapshot alone: share = groups / slots, quota = CPU s / cap (run: / (cap x steps)), pass rate of scored
    (STATUS, None, "a", dict(weight=2.0, priority=1, share_last=0.25, share_run=0.375, quota_last=0.5,
                             quota_run=0.75, episodes=12, pass_rate=0.25, infra_errors=4, retries=3, quarantined=1,
                             breaker="open", level=3)),
    # the snapshot wins over the archive for every field it has
    (STATUS, ARCHIVE, "a", dict(share_run=0.375, episodes=12)),
    # a domain only the archive knows: its counters, no policy, quarantine, breaker or level
    (STATUS, ARCHIVE, "b", dict(weight=None, priority=None, share_last=0.5, share_run=0.25, quota_last=None,
                                episodes=2, pass_rate=0.5, quarantined=None, breaker=None, level=None)),
    # the weighted draw's snapshot: weights and levels from it, counters from the archive
    (WEIGHTED, ARCHIVE, "b", dict(weight=0.5, priority=0, level=1, share_run=0.25, episodes=2, pass_rate=0.5)),
    (WEIGHTED, ARCHIVE, "a", dict(weight=0.5, episodes=9, pass_rate=None, share_last=0.5)),
    # nothing measured: None, never 0
    (WEIGHTED, None, "a", dict(share_last=None, share_run=None, episodes=None, pass_rate=None, retries=None)),
])
def test_rows(status, stats, domain, expected):
    out = {r["domain"]: r for r in status_table.rows(status, stats)}
    assert list(out[domain]) == list(status_table.ROW_COLUMNS)
    assert {k: out[domain][k] for k in expected} == expected


def test_rows_list_every_domain_sorted_and_nothing_without_data():
    assert [r["domain"] for r in status_table.rows(STATUS, ARCHIVE)] == ["a", "b"]
    assert status_table.rows(None, None) == [] and status_table.archive_stats(archive.ARCHIVE_SCHEMA.empty_table()) == \
        {"step": None, "steps": 0, "domains": {}}


def test_status_file_is_replaced_atomically_and_newer_versions_are_refused(tmp_path, monkeypatch):
    status_table.write_status(tmp_path, {"version": 1, "step": 0})
    def broken_dump(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(json, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        status_table.write_status(tmp_path, {"version": 1, "step": 1})
    monkeypatch.undo()
    assert status_table.read_status(tmp_path) == {"version": 1, "step": 0} and os.listdir(tmp_path) == ["status.json"]
    status_table.write_status(tmp_path, {"version": 2})
    with pytest.raises(ValueError, match="status version 2 is newer"):
        status_table.read_status(tmp_path)
    assert status_table.read_status(tmp_path / "none") is None
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['env_cost_s'"):
        status_table.archive_stats(archive.read(tmp_path, columns=["domain", "step"]))


def test_the_rollouters_status_is_the_snapshot_with_the_curriculums_levels(flaky):
    from posttrain.rollout.rollouter import Rollouter

    sched = flaky[0]

    class Levels:
        levels = {"code": 1, "math": 0, "broken": 2}

    fields = dict.fromkeys(("settings", "mesh", "graphdef", "tokenizer", "runner", "advantage_fn"))
    rollouter = Rollouter(**fields, scheduler=sched, train_specs={}, curriculum=Levels())
    assert rollouter.status(7) == status_table.snapshot(7, sched, Levels.levels)
    assert {n: d["level"] for n, d in rollouter.status(7)["domains"].items()} == Levels.levels
    assert Rollouter(**fields, scheduler=sched, train_specs={}).status(7) == status_table.snapshot(7, sched)
