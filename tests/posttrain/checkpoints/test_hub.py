"""Model paths as Hugging Face Hub ids: read from a local cache built here (the snapshot layout huggingface_hub
writes), one line naming the id and the cache when it is not there, never a download."""
import pathlib

import jax
import numpy as np
import pytest

from helpers import random_model
from posttrain.checkpoints import hub, load_pretrained
from posttrain.checkpoints.export import export_hf
from posttrain.checkpoints.policy import ModelRunConfig
from posttrain.config import ConfigError
from posttrain.config.load import convert_section
from posttrain.model.tokenizer import Tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_with(tmp_path, repo_id, source_dir) -> pathlib.Path:
    """A hub cache holding `source_dir`'s files as the snapshot of `repo_id` at main (refs/main -> COMMIT)."""
    cache = tmp_path / "hf" / "hub"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in pathlib.Path(source_dir).iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def tiny_in_cache(tmp_path, monkeypatch):
    cfg, graphdef, state = random_model("tiny-dense", seed=1, vocab_size=320)
    export_hf(cfg, state, tmp_path / "export", tokenizer=Tokenizer.byte_level())
    cache = cache_with(tmp_path, "acme/tiny-dense", tmp_path / "export")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cfg, state, cache


def test_a_hub_id_loads_its_cached_snapshot(tiny_in_cache, tmp_path):
    cfg, state, cache = tiny_in_cache
    assert hub.resolve("acme/tiny-dense") == str(cache / "models--acme--tiny-dense" / "snapshots" / COMMIT)
    assert hub.resolve("acme/tiny-dense@main") == hub.resolve("acme/tiny-dense")
    pre = load_pretrained("acme/tiny-dense")
    assert pre.config.num_layers == cfg.num_layers
    got, want = jax.tree.leaves(pre.state), jax.tree.leaves(state)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):  # the weights exported, through the cache, back
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-7)
    assert convert_section(ModelRunConfig, {"path": "acme/tiny-dense"}, "model").path == "acme/tiny-dense"


@pytest.mark.parametrize("path", ["acme/not-cached", "acme/tiny-dense@v2", "someone/else"])
def test_an_id_not_in_the_cache_is_one_line_naming_the_id_and_the_cache(tiny_in_cache, path):
    _, _, cache = tiny_in_cache
    with pytest.raises(FileNotFoundError) as e:
        hub.resolve(path)
    assert path in str(e.value) and str(cache) in str(e.value) and "download" in str(e.value)
    with pytest.raises(ConfigError, match=rf"model.path.*{path}.*not in the local cache {cache}"):
        convert_section(ModelRunConfig, {"path": path}, "model")


@pytest.mark.parametrize("path", ["runs/nope", "./acme/tiny", "/abs/acme", "model.gguf"])
def test_a_path_that_is_no_id_stays_a_path(tiny_in_cache, path):
    assert not hub.is_hub_id(path) or path == "runs/nope"
    with pytest.raises((ConfigError, FileNotFoundError)):
        convert_section(ModelRunConfig, {"path": path}, "model")
