"""`checkpoints.reward_model` without weights: the export's pad id (never a stop id, so transformers' pooling reads
the reply's end-of-turn token) and the errors for a path that holds no reward model."""
import json

import pytest
from helpers import pad_is_eos_tokenizer

from posttrain.checkpoints import reward_model
from posttrain.model.tokenizer import Tokenizer


def test_export_pad_id_is_never_a_stop_id():
    byte = Tokenizer.byte_level()
    assert reward_model.export_pad_id(byte) == byte.pad_id and byte.pad_id not in byte.stop_ids
    tok = pad_is_eos_tokenizer()  # pad == EOS == end of turn, as SmolLM2's
    pad = reward_model.export_pad_id(tok)
    assert pad not in tok.stop_ids and pad == 0


@pytest.mark.parametrize("config,msg", [
    (None, "no reward model"),
    ({"architectures": ["LlamaForCausalLM"]}, "a reward model is a \\*ForSequenceClassification with one label"),
    ({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "a", "1": "b"}}, "labels=2"),
])
def test_reward_model_dir_errors(tmp_path, config, msg):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises((FileNotFoundError, ValueError), match=msg):
        reward_model.reward_model_dir(tmp_path)


def test_a_run_directory_names_its_export(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # the run's own config.json
    (tmp_path / "reward_model").mkdir()
    (tmp_path / "reward_model" / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}}))
    assert reward_model.reward_model_dir(tmp_path) == tmp_path / "reward_model"
