"""Domain quotas of the job scheduler over many steps (issue 23 acceptance 1): caps never exceeded, min_share
guaranteed in exact counts, priority order when caps bind, credit rotating domains that outnumber the slots."""
import collections
import math

import pytest

from scheduler_fakes import FakeRunner, Source, groups_by_domain
from posttrain.scheduling.scheduler import JobScheduler
from posttrain.scheduling.domain_rules import DomainPolicy, SchedulerSettings, resolve_policies
from posttrain.scheduling.quota import Claim, allocate, share_allowance, water_fill

G, P = 4, 16
POLICIES = (("code/*", DomainPolicy(priority=1, max_share=0.25, max_env_cpu_s=10.0, max_concurrency=8)),
            ("math", DomainPolicy(weight=3.0, min_share=0.25)),
            ("logic", DomainPolicy(max_share=0.5)),
            ("rare", DomainPolicy(weight=0.01, min_share=0.125)),
            ("slim", DomainPolicy(max_share=0.03)))
COSTS = {"code/a": 1.0, "code/b": 1.0, "math": 0.01}  # CPU s per sample: a code group costs 4 s of the 10 s cap


def test_worked_example_of_the_docstring():
    claims = {"code": Claim(weight=1, priority=1, rate_cap=2.0, hard_cap=2),
              "math": Claim(weight=3, min_rate=2.0, rate_cap=8.0, hard_cap=8),
              "logic": Claim(weight=1, rate_cap=8.0, hard_cap=8)}
    counts, credits, x = allocate(claims, 8)
    assert counts == {"code": 2, "math": 5, "logic": 1}
    assert x == pytest.approx({"code": 2.0, "math": 5.0, "logic": 1.0})
    assert credits == pytest.approx(dict.fromkeys(x, 0))
    assert water_fill(6.0, {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 10.0}) == pytest.approx({"a": 1.0, "b": 5.0})
    assert [share_allowance(0.1, 8, c) for c in (0.0, 0.8)] == [(0, pytest.approx(0.8)), (1, pytest.approx(0.6))]


def test_over_200_steps_caps_hold_and_min_share_is_exact():
    names = ["code/a", "code/b", "math", "logic", "rare", "slim"]
    sched = JobScheduler({n: Source(5 + i, n) for i, n in enumerate(names)},
                         SchedulerSettings(policies=POLICIES, group_size=G))
    runner = FakeRunner(sched, costs=COSTS)
    pol = resolve_policies(names, POLICIES)
    totals = collections.Counter()
    for k, log in enumerate(runner.run(200, P)):
        counts = groups_by_domain(log.tickets)
        totals.update(counts)
        assert sum(counts.values()) == P  # every slot is filled
        cpu = collections.Counter()
        for a in log.attempts:
            cpu[a.ticket.domain] += a.cost_s
        for d in names:
            p = pol[d]
            assert counts[d] <= math.ceil(p.max_share * P)  # per step
            assert totals[d] <= math.floor((k + 1) * p.max_share * P + 1e-9)  # over the run
            assert counts[d] >= math.floor(p.min_share * P)  # per step
            assert totals[d] >= math.floor((k + 1) * p.min_share * P)  # over the run
            if p.max_env_cpu_s:
                assert cpu[d] <= p.max_env_cpu_s
            if p.max_concurrency:
                assert log.peak_in_flight[d] <= p.max_concurrency
    # exact counts: code runs one group to measure its cost, then 2 a step (10 s / 4 s per group; concurrency 8 /
    # G = 2); slim's 0.03 x 16 = 0.48 a step allows floor(200 x 0.48) = 96 groups; math and rare get their
    # guarantee (4 and 2 a step) plus their weights' share of the rest
    assert totals["code/a"] == totals["code/b"] == 1 + 199 * 2
    assert totals["slim"] == 96
    assert totals["math"] >= 800 and totals["rare"] >= 400 and sum(totals.values()) == 200 * P


@pytest.mark.parametrize("hi_share, lo_min, expected", [
    (0.5, 0.0, {"hi": 4, "mid": 2, "lo": 2}),  # hi filled to its cap, then mid to its cap, lo the rest
    (1.0, 0.0, {"hi": 8, "mid": 0, "lo": 0}),  # an uncapped top priority takes every slot ...
    (1.0, 0.25, {"hi": 6, "mid": 0, "lo": 2}),  # ... but not a lower domain's min_share
    (0.25, 0.5, {"hi": 2, "mid": 2, "lo": 4}),
])
def test_priority_order_when_caps_bind(hi_share, lo_min, expected):
    policies = (("hi", DomainPolicy(priority=2, max_share=hi_share)), ("mid", DomainPolicy(priority=1, max_share=0.25)),
                ("lo", DomainPolicy(weight=100.0, min_share=lo_min)))
    sched = JobScheduler({n: Source(4, n) for n in expected}, SchedulerSettings(policies=policies, group_size=2))
    runner = FakeRunner(sched)
    for log in runner.run(5, 8):
        assert dict(groups_by_domain(log.tickets)) == {d: n for d, n in expected.items() if n}


def test_domains_outnumbering_the_slots_rotate_by_credit():
    # ten one-weight domains, 4 slots: each is owed 0.4 groups a step; without credit the same four (the name
    # order) would win every step. Table: groups each domain has after k steps.
    names = [f"d{i}" for i in range(10)]
    sched = JobScheduler({n: Source(3, n) for n in names}, SchedulerSettings(group_size=2))
    runner = FakeRunner(sched)
    table = []
    totals = collections.Counter()
    for log in runner.run(10, 4):
        totals.update(groups_by_domain(log.tickets))
        table.append([totals[n] for n in names])
    assert table[4] == [2] * 10 and table[9] == [4] * 10  # 2 groups per 5 steps, exactly
    for k, row in enumerate(table, 1):
        assert all(abs(n - 0.4 * k) < 1 for n in row), (k, row)  # never more than one group behind or ahead


def test_a_starved_domain_catches_up_table():
    # 2 slots, "late" of weight 1 beside two of weight 10: it is owed 2/21 = 0.095 groups a step and loses every
    # slot until its credit beats the big domains' remainders; then it catches up, and its groups never fall a
    # whole group behind its entitlement (the table: step, late's groups so far, its entitlement so far, credit)
    names = {"a": 10.0, "b": 10.0, "late": 1.0}
    sched = JobScheduler({n: Source(5, n) for n in names}, SchedulerSettings(group_size=2), weights=names)
    runner = FakeRunner(sched)
    table, total = [], 0
    for k in range(42):
        total += groups_by_domain(runner.step(k, 2).tickets)["late"]
        table.append((k, total, 2 / 21 * (k + 1), sched.domains["late"].credit))
    assert [k for k, n, _, _ in table if n > (table[k - 1][1] if k else 0)] == [6, 13, 27, 34]
    assert all(abs(n - owed) < 1 and abs(owed - n - credit) < 1e-9 for _, n, owed, credit in table)
    assert table[-1][1] == 4 == round(table[-1][2])  # 42 steps x 0.095 = 4 groups: caught up exactly


def test_unknown_cost_runs_one_group_then_the_estimate_caps_it():
    pol = (("code", DomainPolicy(max_env_cpu_s=9.0)),)
    sched = JobScheduler({"code": Source(6, "c"), "math": Source(6, "m")},
                         SchedulerSettings(policies=pol, group_size=3))
    runner = FakeRunner(sched, costs={"code": 1.0})
    counts = [groups_by_domain(log.tickets)["code"] for log in runner.run(4, 8)]
    assert counts == [1, 3, 3, 3] and sched.domains["code"].cost == 1.0  # 9 s / (3 samples x 1 s)
    m = sched.metrics()
    assert m["tasks/code/quota_used"] == 1.0 and m["tasks/code/cpu_s"] == 9.0 and m["tasks/code/share"] == 3 / 8
