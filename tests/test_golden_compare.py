"""The golden comparisons of tests/helpers.py pass on float32 rounding across CPU kinds and fail on anything larger
(the recordings of tests/golden/ were made on one machine kind; another vectorizes float32 sums differently)."""
import numpy as np
import pytest

from helpers import array_fingerprint, array_hashes, assert_arrays_match, assert_metrics_match

RNG = np.random.default_rng(0)
ARRAYS = {"w": RNG.normal(size=(64, 32)).astype(np.float32), "nu": (RNG.normal(size=512) ** 2 * 1e-6).astype(np.float32)}
ROWS = [{"step": 1, "policy/loss": 0.0256, "optim/grad_norm": 1.2272, "env/episodes": 32, "rollout/logp_diff_max": 9.5e-7}]


def recorded(arrays):
    return array_hashes(arrays), {k: array_fingerprint(x) for k, x in arrays.items()}


def nudged(arrays, name, rel):
    out = dict(arrays)
    out[name] = (arrays[name].astype(np.float64) * (1 + rel)).astype(np.float32)
    return out


@pytest.mark.parametrize("name", ["w", "nu"])
@pytest.mark.parametrize("rel, ok", [(0.0, True), (3e-7, True), (1e-4, False), (1e-2, False)])
def test_arrays_match_within_float32_rounding_only(name, rel, ok):
    sha, fp = recorded(ARRAYS)
    got = nudged(ARRAYS, name, rel)
    if ok:
        assert_arrays_match(got, sha, fp)
    else:
        with pytest.raises(AssertionError, match="1 of 2 arrays differ"):
            assert_arrays_match(got, sha, fp)


def test_changed_bytes_without_a_recorded_fingerprint_fail():
    sha, _ = recorded(ARRAYS)
    with pytest.raises(AssertionError, match="1 of 2 arrays differ"):
        assert_arrays_match(nudged(ARRAYS, "w", 3e-7), sha, {})


@pytest.mark.parametrize("change, ok", [
    ({}, True),
    ({"optim/grad_norm": 1.2272 * (1 + 4e-7)}, True),       # the measured cross-machine difference
    ({"rollout/logp_diff_max": 4.8e-7}, True),              # near 0: within the absolute tolerance
    ({"optim/grad_norm": 1.2272 * (1 + 1e-4)}, False),
    ({"env/episodes": 31}, False),                          # counts compare exactly
    ({"policy/loss": 0.0257}, False),
])
def test_metrics_match_within_float32_rounding_only(change, ok):
    got = [{**ROWS[0], **change}]
    if ok:
        assert_metrics_match(got, ROWS)
    else:
        with pytest.raises(AssertionError, match="beyond float32 rounding"):
            assert_metrics_match(got, ROWS)


def test_metric_rows_with_other_keys_fail():
    with pytest.raises(AssertionError, match="keys differ"):
        assert_metrics_match([{**ROWS[0], "policy/new": 1.0}], ROWS)
