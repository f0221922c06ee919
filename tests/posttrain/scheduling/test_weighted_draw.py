"""Task scheduling: deterministic order, passes roll over, cursor state round-trips (invariant 9)."""
import pytest

from posttrain.scheduling.weighted_draw import TaskScheduler


class Source:
    def __init__(self, n, tag):
        self.n, self.tag = n, tag

    @property
    def num_tasks(self):
        return self.n

    def get_task(self, i):
        return {"id": f"{self.tag}-{i}"}


def ids(pairs):
    return [t["id"] for _, t in pairs]


def test_same_seed_same_order_and_every_task_once_per_pass():
    a = TaskScheduler({"x": Source(8, "x")}, {"x": 1.0}, seed=3)
    b = TaskScheduler({"x": Source(8, "x")}, {"x": 1.0}, seed=3)
    first = ids(a.next_tasks(0, 4)) + ids(a.next_tasks(1, 4))
    assert first == ids(b.next_tasks(0, 4)) + ids(b.next_tasks(1, 4))
    assert sorted(first) == sorted(f"x-{i}" for i in range(8))
    assert first != ids(TaskScheduler({"x": Source(8, "x")}, {"x": 1.0}, seed=4).next_tasks(0, 8))


def test_checkpoint_at_end_of_pass_resumes_into_next_pass():
    a = TaskScheduler({"x": Source(8, "x")}, {"x": 1.0}, seed=0)
    a.next_tasks(0, 4), a.next_tasks(1, 4)  # exactly one pass
    state = a.state_dict()
    assert state["cursors"]["x"] == {"epoch": 1, "index": 0}
    b = TaskScheduler({"x": Source(8, "x")}, {"x": 1.0}, seed=0)
    b.load_state_dict(state)
    nxt = ids(b.next_tasks(2, 8))
    assert nxt == ids(a.next_tasks(2, 8))
    assert sorted(nxt) == sorted(f"x-{i}" for i in range(8))  # a full second pass, not a stop


def test_mix_follows_weights_and_bad_input_raises():
    s = TaskScheduler({"a": Source(100, "a"), "b": Source(100, "b")}, {"a": 3.0, "b": 1.0}, seed=0)
    picks = [d for step in range(50) for d, _ in s.next_tasks(step, 8)]
    assert 0.65 < picks.count("a") / len(picks) < 0.85
    with pytest.raises(ValueError, match="positive weight"):
        TaskScheduler({"a": Source(2, "a")}, {"a": 0.0})
    with pytest.raises(ValueError, match="domains"):
        s.load_state_dict({"cursors": {"c": {"epoch": 0, "index": 0}}})
