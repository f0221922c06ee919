"""A preset's random weights written as an HF model directory, for benchmarks that compare against transformers or
TRL on the same weights (a helper of `bench/`, not a benchmark)."""
from __future__ import annotations

INIT_STD = 0.02  # standard deviation of every weight matrix and the embedding (norm scales are ones)


def write_preset_model(name: str, out_dir: str, overrides: dict | None = None, seed: int = 0):
    """Writes preset `name` (float32, `overrides` applied; a vocabulary smaller than the byte tokenizer's gets 320
    ids) with random weights and the byte tokenizer to `out_dir` (`posttrain.checkpoints.export.export_hf`);
    returns its ModelConfig. Weights: NumPy normal(0, INIT_STD) of `seed`, norm scales ones, filled into the shapes
    of `nnx.eval_shape` (instant, where the model's own jax.random init costs seconds of XLA compiles on a CPU).
    Raises KeyError for an unknown preset."""
    import jax
    import numpy as np
    from flax import nnx

    from posttrain.checkpoints.export import export_hf
    from posttrain.model.presets import get_preset
    from posttrain.model.tokenizer import Tokenizer
    from posttrain.model.transformer import Transformer

    tokenizer = Tokenizer.byte_level()
    fields = dict(dtype="float32", param_dtype="float32", **(overrides or {}))
    cfg = get_preset(name, **fields)
    if cfg.vocab_size < tokenizer.vocab_size:
        cfg = get_preset(name, **{**fields, "vocab_size": 320})
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(leaf.shape, np.float32)
        return (INIT_STD * rng.standard_normal(leaf.shape, np.float32)).astype(np.float32)

    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed))))
    export_hf(cfg, jax.tree_util.tree_map_with_path(fill, abstract), out_dir, tokenizer=tokenizer)
    return cfg
