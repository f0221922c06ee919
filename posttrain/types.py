"""Pytree containers passed between phases (`RolloutBatch`, `ImageBatch`, `TrainState`) and the one shape legend.

Model inputs are row-shaped ([R, L]); everything the loss needs is sample-shaped ([N, C]). Slot c of sample n
holds token `targets_NxC[n, c]`, predicted by the hidden state at position `score_pos_NxC[n, c]` of row n // S:
one prompt's hidden states serve all G completions (packed rows), and the loss reads only the C scored slots.
"""

# SHAPE LEGEND
# Names carry their shapes as suffixes (`logits_BxTxV`: a [B, T, V] array). Every module refers here; a letter
# means one thing within each scope below (the scope is the package a module lives in).
#
# Training batches (types, rollout, learn, algos, eval):
#   R  model-input rows (one sequence, or a prompt followed by its G completions when packed); L  row width
#   N  sampled sequences (samples), N = R * S; S  samples per row (G when packed, else 1)
#   C  scored slots per sample (the completion region: generated tokens; tool/env tokens masked out)
#   P  prompts of a step; G  group size (samples per prompt); Lp, Lg  prompt and generated widths
#   B, T  rows and positions of a loss call that takes either layout (N x C samples, or R x L rows with seq ids)
#   I  images of a batch; H, W  image height and width (pixels)
# Model (model/): B batch rows, T query positions, S key positions, D d_model, V vocabulary, L layers of a stack,
#   N query heads, K key/value heads, H head dim, E experts (value head dim in attention kernels), k experts per
#   token, F MLP hidden, M tokens of a MoE call (B * T), C capacity / key block, Q query block, I, J query / key
#   blocks, G query heads per key/value head, R MLA latent rank, P MLA rotary dims, m, n tokens / assignment rows of
#   one expert shard, El experts per shard, Nb padded blocks
# Engine (generate/): S slots, R requests, P pages in the pool, Z tokens per page, M pages per sequence, W prefill
#   width, K decode steps of a chunk (key/value heads in kv_pages, page_writes, paged_attention), L layers, H head
#   dim, C MLA compressed dims (page copies in admission), N rows of a sampler call, V vocabulary
# Checkpoints (checkpoints/): O, I output and input features, r adapter rank, D hidden, F MLP hidden, E experts,
#   N query heads, K key/value heads, H head dim
from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class RolloutBatch:
    """A training batch (all arrays; shapes static per bucket so new batches do not recompile).

    tokens_RxL, positions_RxL, segment_ids_RxL (0 = padding), branch_ids_RxL (0 = shared prefix): int32.
    targets_NxC, score_pos_NxC: int32. loss_mask_NxC: bool, True on policy tokens only (not prompt, not
    tool/env output, not padding; includes the stop token the policy produced).
    logp_sample_NxC: float32 sampler logprobs, `log_softmax(logits / T)` at each target.
    advantages_N: float32. rewards_N: float32. valid_N: bool (False: excluded, e.g. infra error).
    truncated_N: bool (hit the token limit). group_id_N: int32.
    logp_old_NxC: float32 trainer logprobs under the behaviour policy, filled in by the train step before the
    first of several updates on one batch (`rl.ppo_epochs`, `rl.minibatches`); None otherwise.
    routed_experts_RxLxLmxk: routing replay (`rl.routing_replay="replay"` on an MoE model; else None): int32
    [R, L, Lm, k], the experts the sampler's Lm MoE layers selected for every row token, -1 where it has none
    (the last generated token, padding, env tokens): the train step selects these (`moe.route(replay_Mxk=)`).
    """

    tokens_RxL: jax.Array
    positions_RxL: jax.Array
    segment_ids_RxL: jax.Array
    branch_ids_RxL: jax.Array
    targets_NxC: jax.Array
    score_pos_NxC: jax.Array
    loss_mask_NxC: jax.Array
    logp_sample_NxC: jax.Array
    advantages_N: jax.Array
    rewards_N: jax.Array
    valid_N: jax.Array
    truncated_N: jax.Array
    group_id_N: jax.Array
    logp_old_NxC: Any = None
    routed_experts_RxLxLmxk: Any = None

    @property
    def samples_per_row(self) -> int:
        return self.targets_NxC.shape[0] // self.tokens_RxL.shape[0]


@struct.dataclass
class TrainState:
    """Everything a step reads and writes; checkpointed as one pytree.

    params: trainable nnx State (all Params, or only LoRA adapters). frozen: non-trainable nnx State (MoE
    routing biases; the frozen base Params under LoRA). ref_params: the initial trainable params (all Params,
    or the initial LoRA adapters) when a KL term needs the reference model (the initial policy), else None.
    step: int32 scalar, completed optimizer updates. rng: the run's PRNG key (sampling keys are derived
    from it by step, never reused).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    frozen: Any
    ref_params: Any
    rng: jax.Array


@struct.dataclass
class ImageBatch:
    """Images a batch's samples carry, a pytree of its own beside `RolloutBatch` (image-text runs; None otherwise).

    pixels_IxHxWx3: float32 RGB in [0, 1]. sample_I: int32, the sample (index into the batch's N) each image
    belongs to. token_pos_I: int32, the row position of each image's first placeholder token.
    """

    pixels_IxHxWx3: jax.Array
    sample_I: jax.Array
    token_pos_I: jax.Array
