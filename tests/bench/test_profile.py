"""bench/_profile.py: own time of nested ops, the union of busy intervals, and a traced call's summary on the CPU."""
import pathlib

import jax
import jax.numpy as jnp
import pytest
from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
prof = load_script(ROOT / "bench" / "_profile.py", "bench_profile")


@pytest.mark.parametrize("events, own", [
    ([(0, 10), (1, 3), (5, 2), (6, 1)], [5, 3, 1, 1]),  # a while op holding two ops, one holding another
    ([(0, 4), (4, 4)], [4, 4]),                          # back to back: neither holds the other
    ([(5, 2), (0, 10)], [2, 8]),                         # listed out of order
    ([(0, 3), (0, 3)], [0, 3]),                          # the same interval twice: the first listed holds the other
])
def test_own_time_subtracts_the_ops_nested_in_an_op(events, own):
    assert prof._self_ns([(s, d, None, {}) for s, d in events]) == own


@pytest.mark.parametrize("intervals, ns", [([], 0), ([(0, 5), (3, 8)], 8), ([(0, 2), (4, 6)], 4),
                                           ([(0, 10), (2, 3), (11, 12)], 11)])
def test_busy_time_is_the_union_of_the_intervals(intervals, ns):
    assert prof._union_ns(intervals) == ns


def test_a_traced_call_sums_its_xla_ops():
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    out = prof.profile_call(lambda: f(x), top=3)
    assert out["planes"] == ["/host:CPU"] and out["events"] >= 1 and len(out["top_ops"]) <= 3
    assert 0 < out["busy_s"] <= out["wall_s"] and out["op_s"] >= out["busy_s"] - 1e-4
    assert "jit__lambda" in out["modules"] and all(op["module"] == "jit__lambda" for op in out["top_ops"])
    assert all(op["s"] >= 0 and op["count"] >= 1 for op in out["top_ops"])
