"""Loading the policy a run starts from: the model (a preset with fresh weights, or a GGUF / HF checkpoint) created
sharded on the run's mesh under its precision policy, and its tokenizer. Upstream of both run phases
(`posttrain.rollout.rollouter`, `posttrain.learn.learner`); `posttrain.recipes.grpo.build` wires them.
"""
from __future__ import annotations

from flax import nnx

from posttrain.config import Config
from posttrain.infra.precision import PrecisionPolicy, resolve_policy


def load_policy(cfg: Config, mesh, policy: PrecisionPolicy | None = None, rules=None):
    """(ModelConfig, graphdef, state, tokenizer) from the configured source, under the precision policy (default:
    the config's, resolved for this backend), its parameters sharded on `mesh` by `rules` (default: `mesh.RULES`
    with the config's `mesh.rules` overlays). Raises AssertionError (`partitioning.assert_sufficiently_sharded`)
    when the rules leave most of a large model's parameter elements replicated on a multi-device mesh."""
    from posttrain.checkpoints import load_pretrained
    from posttrain.model.presets import get_preset
    from posttrain.model.transformer import Transformer
    from posttrain.infra import mesh as mesh_lib
    from posttrain.infra.partitioning import assert_sufficiently_sharded, create_sharded
    from posttrain.model.tokenizer import Tokenizer

    m = cfg.model
    rules = rules if rules is not None else mesh_lib.rules_with_overrides(cfg.mesh.rules)
    lora = cfg.lora if cfg.lora.rank else None
    policy = policy or resolve_policy(m.dtype, m.param_dtype, m.matmul_precision)
    fields = dict(dtype=policy.compute_dtype, param_dtype=policy.param_dtype, matmul_precision=policy.matmul_precision,
                  remat=m.remat, remat_names=tuple(m.remat_names), lora=lora, moe_gmm_impl=m.moe_gmm_impl,
                  moe_capacity_factor=m.moe_capacity_factor, moe_ep_capacity_factor=m.moe_ep_capacity_factor,
                  attention_impl=m.attention_impl, grad_dtype=m.grad_dtype)
    if m.preset:
        mcfg = get_preset(m.preset, **fields, **dict(m.overrides))
        tokenizer = Tokenizer.byte_level()
        if mcfg.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"preset {m.preset!r} has vocab_size {mcfg.vocab_size} < {tokenizer.vocab_size} ids of "
                             "the byte tokenizer; set model.overrides.vocab_size")
        graphdef, state = create_sharded(lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.train.seed)), mesh, rules)
        assert_sufficiently_sharded(state, mesh)
        return mcfg, graphdef, state, tokenizer
    pre = load_pretrained(m.path or None, mesh=mesh, rules=rules, **fields)
    if pre.tokenizer is None:
        raise ValueError(f"{m.path}: no tokenizer found next to the weights (tokenizer.json)")
    assert_sufficiently_sharded(pre.state, mesh)
    return pre.config, pre.graphdef, pre.state, pre.tokenizer
