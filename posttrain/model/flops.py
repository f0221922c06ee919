"""Model FLOPs of a GRPO train step for MFU, counted as MaxText does (recomputation not counted).

FLOPs = 6 x active non-embedding params x tokens + 6 x D x V x scored tokens + 6 x (qk + v head dims) x heads x
attended pairs x layers (LoRA: 4, not 6, for frozen weights); active: an MoE layer's k routed (+ shared) experts;
a token attends position + 1 keys. Source: PaLM (Chowdhery et al. 2022, appendix B), MaxText's
`calculate_tflops_training_per_device`."""
from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from posttrain.model.config import ModelConfig
from posttrain.model.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class StepFlops:
    matmul: float  # 6 x active non-embedding params x tokens
    lm_head: float
    attention: float
    tokens: int
    scored_tokens: int
    active_params: int  # non-embedding, per token
    total_params: int

    @property
    def total(self) -> float:
        return self.matmul + self.lm_head + self.attention


def _param_counts(cfg: ModelConfig, model_state) -> tuple[int, int, int, int]:
    """(total, embedding + lm_head, active non-embedding, LoRA adapter) parameter counts of an nnx State."""
    total = embed = inactive = lora = 0
    moe = cfg.moe
    for path, v in nnx.to_flat_state(model_state):
        n = int(np.prod(v.get_value().shape))
        total += n
        names = [str(p) for p in path]
        if names[-1] in ("embedding", "lm_head"):
            embed += n
        elif "_lora_" in names[-1]:
            lora += n
        elif moe is not None and "moe_layers" in names and "shared" not in names and \
                names[-1] in ("gate_proj", "up_proj", "down_proj"):
            inactive += n * (moe.num_experts - moe.num_experts_per_tok) // moe.num_experts
    return total, embed, total - embed - inactive, lora


def attention_pairs(positions_RxL, segment_ids_RxL) -> int:
    """Sum over non-padding tokens of (position + 1): the (query, key) pairs of causal, branch-masked rows."""
    pos, seg = np.asarray(positions_RxL), np.asarray(segment_ids_RxL)
    return int(((pos + 1) * (seg != 0)).sum())


def train_step_flops(cfg: ModelConfig, model_state, batch, *, lora: bool = False) -> StepFlops:
    """Model FLOPs of one update on `batch` (a RolloutBatch); only the shapes of `model_state` are read."""
    total, embed, active, adapters = _param_counts(cfg, model_state)
    tokens = int((np.asarray(batch.segment_ids_RxL) != 0).sum())
    scored = int((np.asarray(batch.loss_mask_NxC) & np.asarray(batch.valid_N)[:, None]).sum())
    base = active - adapters
    matmul = (4 * base + 6 * adapters if lora else 6 * active) * tokens
    lm_head = (4 if lora else 6) * cfg.d_model * cfg.vocab_size * scored
    if cfg.mla is not None:
        qk, vd = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    else:
        qk = vd = cfg.head_dim
    attention = 3 * 2 * (qk + vd) * cfg.num_heads * attention_pairs(batch.positions_RxL, batch.segment_ids_RxL) \
        * cfg.num_layers
    return StepFlops(float(matmul), float(lm_head), float(attention), tokens, scored, active, total)


def abstract_model_state(cfg: ModelConfig):
    """The model's nnx State as ShapeDtypeStructs (no weights allocated)."""
    return nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

