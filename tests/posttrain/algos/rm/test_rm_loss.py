"""The Bradley-Terry loss (with reward centering) against NumPy, the loss registry against the config's names, and
the pair layout's last-token positions against a NumPy scan of a real DPO pair batch."""
import numpy as np
import pytest

from posttrain.algos.dpo import data
from posttrain.algos.rm import losses
from posttrain.algos.rm.step import StepOptions, last_positions, pair_terms
from posttrain.config.rm import LOSS_NAMES
from posttrain.model.tokenizer import Tokenizer


def np_bradley_terry(rc, rr, center):
    d = rc.astype(np.float64) - rr
    return np.log1p(np.exp(-d)) + center * (rc.astype(np.float64) + rr) ** 2  # -log sigmoid(d) + c (rc + rr)^2


@pytest.mark.parametrize("center", [0.0, 0.01, 1.0])
@pytest.mark.parametrize("rc,rr", [
    ([0.0, 1.0, -2.0, 5.0], [0.0, -1.0, 3.0, 4.5]),
    ([30.0, -30.0], [-30.0, 30.0]),  # saturated: finite both ways
    ([0.25], [0.25]),
])
def test_bradley_terry_matches_numpy(rc, rr, center):
    rc, rr = np.asarray(rc, np.float32), np.asarray(rr, np.float32)
    got = np.asarray(losses.bradley_terry_loss(rc, rr, center))
    np.testing.assert_allclose(got, np_bradley_terry(rc, rr, center), rtol=1e-6, atol=1e-6)


def test_registry_and_settings():
    assert tuple(losses.LOSSES) == LOSS_NAMES
    with pytest.raises(ValueError, match="unknown reward-model loss 'hinge'"):
        losses.loss_fn("hinge")
    with pytest.raises(ValueError, match="center_coef must be a finite number >= 0, got -0.1"):
        losses.check_settings("bradley_terry", -0.1)


def test_pair_terms_accuracy_counts_ties_half():
    r_N = np.asarray([2.0, 1.0, 0.5, 0.5, -1.0, 3.0], np.float32)  # pairs: win, tie, loss
    t = pair_terms(r_N, StepOptions(center_coef=0.5))
    np.testing.assert_array_equal(np.asarray(t["rm/train_accuracy"]), [1.0, 0.5, 0.0])
    np.testing.assert_allclose(np.asarray(t["rm/train_margin"]), [1.0, 0.0, -4.0])
    np.testing.assert_allclose(np.asarray(t["rm/loss"]), np_bradley_terry(r_N[0::2], r_N[1::2], 0.5), rtol=1e-6)


def test_last_positions_find_each_replys_last_token():
    tok = Tokenizer.byte_level()
    records = [("a", {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "It is six."}),
               ("b", {"prompt": "Hi", "chosen": "Hello there!", "rejected": "Go"})]
    pairs = data.encode_pairs(tok, records, data.PairSettings())
    batch = data.make_batch(pairs, *data.regions(pairs), tok.pad_id, num_pairs=3)  # one padding row
    rows, last = (np.asarray(x) for x in last_positions(batch.segment_ids_RxL, batch.branch_ids_RxL, 2))
    np.testing.assert_array_equal(rows, [0, 0, 1, 1, 2, 2])
    for n, p in enumerate(pairs):
        for k, reply in enumerate((p.chosen, p.rejected)):
            i = 2 * n + k
            mine = np.nonzero((batch.branch_ids_RxL[n] == k + 1) & (batch.segment_ids_RxL[n] != 0))[0]
            assert last[i] == mine.max()
            assert batch.tokens_RxL[n, last[i]] == reply[-1] == tok.stop_ids[0]  # the end-of-turn token
    assert list(last[4:]) == [0, 0]  # the padding row
    seg = np.asarray([[1, 1, 1, 0], [1, 0, 0, 0]], np.int32)  # one sequence per row
    _, last1 = last_positions(seg, np.zeros_like(seg), 1)
    assert list(np.asarray(last1)) == [2, 0]
