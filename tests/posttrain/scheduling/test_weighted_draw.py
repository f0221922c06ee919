"""Task scheduling: deterministic order, passes roll over, cursor state round-trips (invariant 9)."""
import pytest

from posttrain.scheduling.weighted_draw import WeightedDraw


class Source:
    def __init__(self, n, tag):
        self.n, self.tag = n, tag

    @property
    def num_tasks(self):
        return self.n

    def get_task(self, i):
        return {"id": f"{self.tag}-{i}"}


def ids(tickets):
    return [t.task["id"] for t in tickets]


def test_same_seed_same_order_and_every_task_once_per_pass():
    a = WeightedDraw({"x": Source(8, "x")}, {"x": 1.0}, seed=3)
    b = WeightedDraw({"x": Source(8, "x")}, {"x": 1.0}, seed=3)
    first = ids(a.next_tasks(0, 4)) + ids(a.next_tasks(1, 4))
    assert first == ids(b.next_tasks(0, 4)) + ids(b.next_tasks(1, 4))
    assert sorted(first) == sorted(f"x-{i}" for i in range(8))
    assert first != ids(WeightedDraw({"x": Source(8, "x")}, {"x": 1.0}, seed=4).next_tasks(0, 8))


def test_checkpoint_at_end_of_pass_resumes_into_next_pass():
    a = WeightedDraw({"x": Source(8, "x")}, {"x": 1.0}, seed=0)
    a.next_tasks(0, 4), a.next_tasks(1, 4)  # exactly one pass
    state = a.state_dict()
    assert state["cursors"]["x"] == {"epoch": 1, "index": 0}
    b = WeightedDraw({"x": Source(8, "x")}, {"x": 1.0}, seed=0)
    b.load_state_dict(state)
    nxt = ids(b.next_tasks(2, 8))
    assert nxt == ids(a.next_tasks(2, 8))
    assert sorted(nxt) == sorted(f"x-{i}" for i in range(8))  # a full second pass, not a stop


def test_mix_follows_weights_and_bad_input_raises():
    s = WeightedDraw({"a": Source(100, "a"), "b": Source(100, "b")}, {"a": 3.0, "b": 1.0}, seed=0)
    picks = [t.domain for step in range(50) for t in s.next_tasks(step, 8)]
    assert 0.65 < picks.count("a") / len(picks) < 0.85
    with pytest.raises(ValueError, match="positive weight"):
        WeightedDraw({"a": Source(2, "a")}, {"a": 0.0})
    with pytest.raises(ValueError, match="domains"):
        s.load_state_dict({"cursors": {"c": {"epoch": 0, "index": 0}}})


def test_tickets_and_reports_follow_the_scheduler_interface():
    """next_tasks gives whole-group tickets numbered within the step, each round of a step drawing anew; report
    returns every reported ticket's group complete, in ticket order, with its rewards."""
    from posttrain.scheduling.tickets import Outcome

    s = WeightedDraw({"x": Source(8, "x")}, {"x": 1.0}, seed=0, group_size=2, run="r")
    first, second = s.next_tasks(5, 2), s.next_tasks(5, 1)
    assert [t.ticket_id for t in first + second] == [0, 1, 2] and {t.step for t in first} == {5}
    assert first[0].samples == (0, 1) and first[0].attempt == 0 and first[0].episode_id(1).startswith("r:x:")
    result = s.report([Outcome(1, 1, "ok", 1.0), Outcome(0, 0, "wrong", 0.0), Outcome(0, 1, "ok", 1.0),
                       Outcome(1, 0, "infra_error", 0.0)])
    assert [g.group_key for g in result.complete] == [first[0].group_key, first[1].group_key]
    assert result.complete[0].rewards == (0.0, 1.0) and result.complete[0].attempts == (0, 0)
    assert not result.retries and not result.dropped
    assert [t.ticket_id for t in s.next_tasks(6, 1)] == [0]  # a new step numbers from 0
