"""DPO data errors, the reference-logprob cache (round trip, hash mismatch, corrupt file), and `posttrain dpo`'s
recipe end to end on configs/dpo_tiny.py: 2 steps, then a resume to 3 that reuses the cached reference logprobs,
with TRL's metric names logged once per step."""
import json
import sys

import pytest

from posttrain.algos.dpo import data, reference
from posttrain.config import ConfigError, DataError
from posttrain.config.dpo import dpo_config_from_dict
from posttrain.model.tokenizer import Tokenizer

sys.path.insert(0, "configs")
import dpo_tiny  # noqa: E402


@pytest.mark.parametrize("record,err,msg", [
    ({"prompt": "a", "chosen": "b"}, ValueError, r"missing key\(s\) \['rejected'\]"),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
      "rejected": "d"}, ValueError, "'chosen' must be one assistant turn"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "chosen": "c",
      "rejected": "d"}, ValueError, "prompt ends with an assistant turn"),
    ({"prompt": "a", "chosen": [{"role": "assistant"}], "rejected": "d"}, ValueError, r"chosen\[0\] must be"),
    (["not", "a", "mapping"], TypeError, "must be a mapping"),
])
def test_malformed_records_name_the_record(record, err, msg):
    with pytest.raises(err, match=msg) as e:
        data.encode_pair(Tokenizer.byte_level(), record, "pairs.jsonl:7", 64, 64)
    assert "pairs.jsonl:7" in str(e.value)


def test_implicit_prompt_records_equal_explicit_ones():
    """TRL's implicit-prompt format: the prompt is the messages both conversations begin with."""
    tok = Tokenizer.byte_level()
    user, sys_ = {"role": "user", "content": "2 + 2?"}, {"role": "system", "content": "Be brief."}
    ans = lambda c: {"role": "assistant", "content": c}
    explicit = data.encode_pair(tok, {"prompt": [sys_, user], "chosen": "4", "rejected": "5"}, "a", 64, 64)
    implicit = data.encode_pair(tok, {"chosen": [sys_, user, ans("4")], "rejected": [sys_, user, ans("5")]},
                                "a", 64, 64)
    for x, y in zip(explicit[1:4], implicit[1:4]):
        assert x.tolist() == y.tolist()
    for record, msg in (({"chosen": "4", "rejected": "5"}, r"string replies need a 'prompt'"),
                        ({"chosen": [ans("4")], "rejected": [ans("5")]}, "do not begin with the same messages"),
                        ({"chosen": [user, ans("4")], "rejected": [user, ans("4"), user, ans("5")]},
                         "must be one assistant turn")):
        with pytest.raises(DataError, match=msg):
            data.encode_pair(tok, record, "pairs.jsonl:3", 64, 64)


def test_tied_pairs_are_counted_and_all_tied_data_refused(caplog):
    tok = Tokenizer.byte_level()
    tie, pair = {"prompt": "q", "chosen": "same", "rejected": "same"}, {"prompt": "q", "chosen": "a", "rejected": "b"}
    cut = {"prompt": "q", "chosen": "abcdefgh-x", "rejected": "abcdefgh-y"}  # equal after the 8-token cut
    settings = data.PairSettings(train_records=(tie, pair, cut), max_completion_len=8)
    with caplog.at_level("WARNING"):
        train, _ = data.load_pairs(settings, tok)
    assert [data.tied(p) for p in train] == [True, False, True]
    assert "2 of 3 preference pairs from train_examples have chosen == rejected" in caplog.text
    with pytest.raises(DataError, match="every one of the 2 preference pairs from train_examples has chosen == "
                                        "rejected"):
        data.load_pairs(data.PairSettings(train_records=(tie, cut), max_completion_len=8), tok)


def test_duplicate_ids_and_truncation():
    tok, r = Tokenizer.byte_level(), {"id": "x", "prompt": "p" * 50, "chosen": "c" * 40, "rejected": "r"}
    with pytest.raises(ValueError, match=r"duplicate preference pair ids \['x'\]"):
        data.encode_pairs(tok, [("a", r), ("b", r)], data.PairSettings())
    p = data.encode_pair(tok, r, "a", max_prompt_len=16, max_completion_len=8)
    full = data.encode_pair(tok, r, "a", 256, 256)
    assert p.truncated and not full.truncated and len(p.prompt) == 16 and len(p.chosen) == 8
    assert (p.prompt == full.prompt[-16:]).all() and (p.chosen == full.chosen[:8]).all()  # keep_end / keep_start


def test_reference_cache_round_trip_and_mismatch(tmp_path):
    path = tmp_path / "ref.parquet"
    logps = {"a": (-3.5, -7.25), "b": (-1.0, -0.5)}
    reference.write(path, logps, "model1", "data1")
    assert reference.read(path, "model1", "data1") == logps
    assert reference.read(path, "model2", "data1") is None and reference.read(path, "model1", "data2") is None
    assert list(reference.as_samples(["b", "a"], logps)) == [-1.0, -0.5, -3.5, -7.25]
    path.write_bytes(b"PAR1 not really")
    assert reference.read(path, "model1", "data1") is None
    assert [p.name for p in tmp_path.iterdir()] == ["ref.parquet"]  # no temporary file left behind


def test_config_errors():
    c = dpo_tiny.get_config()
    c.dpo.loss = "kto"
    with pytest.raises((ConfigError, ValueError), match="loss"):
        dpo_config_from_dict(c)
    c = dpo_tiny.get_config()
    c.dpo.train_examples = ()
    with pytest.raises(ConfigError, match="no training data"):
        dpo_config_from_dict(c)


def test_dpo_tiny_trains_resumes_and_reuses_the_reference_cache(tmp_path):
    from posttrain.recipes import dpo

    cfg = dpo_tiny.get_config()
    cfg.train.steps = 2
    cfg.checkpoint.every_steps = 1
    cfg.dpo.eval_at_end = False  # held-out evaluation runs once, at the start
    first = dpo.train(dpo.make_dpo_plan(dpo_config_from_dict(cfg), workdir=str(tmp_path)), progress=False)
    assert first["data"]["dpo/reference_cached"] is False and first["end_step"] == 2
    assert first["eval_start"]["dpo/eval_accuracy"] == 0.5 and first["eval_start"]["dpo/eval_margin"] == 0.0
    assert first["eval_start"]["dpo/eval_pairs"] == 4.0
    cfg.train.steps = 3
    second = dpo.train(dpo.make_dpo_plan(dpo_config_from_dict(cfg), workdir=str(tmp_path)), progress=False)
    assert second["start_step"] == 2 and second["end_step"] == 3 and second["data"]["dpo/reference_cached"] is True
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r["step"] for r in rows if "dpo/loss" in r]
    assert steps == [1, 2, 3]
    keys = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"}
    assert all(keys <= set(r) for r in rows if "dpo/loss" in r)
    assert (tmp_path / "reference_logps.parquet").is_file()
