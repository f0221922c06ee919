"""A scalar reward model: the decoder's final hidden states read by a Linear D -> 1 head at each reply's last token.

The pooling of transformers' `*ForSequenceClassification`. Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.infra.partitioning import create_sharded
from posttrain.infra.precision import DTYPES, matmul_scope
from posttrain.model.config import ModelConfig
from posttrain.model.layers import param
from posttrain.model.transformer import Transformer


class ScoreHead(nnx.Module):
    """The reward head `score` [D, 1]: `init` (float [D, 1]) when given, else zeros (every reward 0 at the start)."""

    def __init__(self, d_model: int, *, param_dtype, rngs: nnx.Rngs, init=None):
        self.score = param(rngs, (d_model, 1), ("embed", None), param_dtype, init="zeros")
        if init is not None:
            self.score = nnx.Param(jnp.asarray(init, param_dtype).reshape(d_model, 1), logical_axes=("embed", None))


def head_scores(h_BxTxD, rows_N, last_N, score_Dx1) -> jax.Array:
    """float32 [N]: the hidden state of row rows_N[n] at position last_N[n] (int32 [N] each) times the head."""
    h_NxD = h_BxTxD[rows_N, last_N].astype(jnp.float32)
    return jnp.einsum("nd,do->no", h_NxD, score_Dx1.astype(jnp.float32))[:, 0]


class RewardModel(nnx.Module):
    """A `Transformer` backbone (`backbone`) and its `ScoreHead` (`head`)."""

    def __init__(self, backbone: Transformer, head: ScoreHead):
        self.backbone, self.head = backbone, head

    def __call__(self, tokens_BxT, positions_BxT, segment_ids_BxT, branch_ids_BxT, rows_N, last_N) -> jax.Array:
        """float32 [N] rewards of the replies ending at (rows_N, last_N) in the (possibly packed) rows."""
        with matmul_scope(self.backbone.matmul_precision):
            h, _ = self.backbone.hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT, branch_ids_BxT)
            return head_scores(h, rows_N, last_N, self.head.score[...])

    def score_sequences(self, tokens_BxT, lengths_B) -> jax.Array:
        """float32 [B] rewards of right-padded single sequences (prompt + reply, int32 [B, T]; lengths_B >= 1)."""
        B, T = tokens_BxT.shape
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        seg = (pos < lengths_B[:, None]).astype(jnp.int32)
        return self(tokens_BxT, pos, seg, jnp.zeros_like(seg), jnp.arange(B), jnp.maximum(lengths_B - 1, 0))


def with_head(cfg: ModelConfig, graphdef, state, mesh, rules, *, seed: int = 0, score=None):
    """(graphdef, state) of a `RewardModel`: the backbone's arrays reused, a new head sharded on `mesh` by `rules`.

    score: float [D, 1] or [1, D] head weights (e.g. an exported head); None: zeros."""
    init = None if score is None else np.asarray(score, np.float32).reshape(cfg.d_model, 1)
    head_def, head_state = create_sharded(
        lambda: ScoreHead(cfg.d_model, param_dtype=DTYPES[cfg.param_dtype], rngs=nnx.Rngs(seed), init=init),
        mesh, rules)
    backbone = nnx.merge(graphdef, *(state if isinstance(state, tuple) else (state,)))
    return nnx.split(RewardModel(backbone, nnx.merge(head_def, head_state)))
