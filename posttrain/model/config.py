"""Model architecture configuration: frozen, keyword-only dataclasses validated on construction.

They describe a decoder's shape; layers receive the few fields they need. Presets: `posttrain.model.presets`."""
from __future__ import annotations

import dataclasses

_DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("default", "high", "highest")  # the names of `posttrain.infra.precision`
REMAT_MODES = ("none", "dots", "names", "full")
GRAD_DTYPES = ("param", "compute")  # see ModelConfig.grad_dtype
REMAT_NAMES = ("dot", "qkv", "attn_out", "mlp_in")  # `posttrain.model.layers.CHECKPOINT_NAMES`


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary position embedding (Su et al. 2021, "RoFormer") and its context-extension variants.

    Raises ValueError on an unknown type or a missing factor. Formulas: `posttrain.model.layers.rope_frequencies`.

    Attributes:
        theta: the base of the inverse frequencies theta^(-2i/d).
        type: "default" | "linear" (position interpolation) | "llama3" (Llama 3.1) | "yarn" (arXiv:2309.00071).
        factor: the context-extension factor (> 0 unless type is "default").
        original_max_position: the pre-extension context length (> 0 for llama3 and yarn).
        low_freq_factor: llama3: wavelengths above original_max_position / this are scaled by 1 / factor.
        high_freq_factor: llama3: wavelengths below original_max_position / this are kept.
        beta_fast: yarn: the rotation count where the ramp to interpolation starts.
        beta_slow: yarn: the rotation count where it ends.
        mscale: yarn: the attention-scale coefficient (0.1 * mscale * ln(factor) + 1), with mscale_all_dim.
        mscale_all_dim: yarn: the coefficient it is divided by (DeepSeek-V3; MLA also scales its softmax by it).
        attention_factor: yarn: the cos/sin scale itself, overriding mscale (None: from mscale).
        truncate: yarn: round the ramp's ends to whole dimensions (floor / ceil).
    """

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.type not in ("default", "linear", "llama3", "yarn"):
            raise ValueError(f"RopeConfig.type={self.type!r}; expected default|linear|llama3|yarn")
        if self.type != "default" and self.factor <= 0:
            raise ValueError(f"RopeConfig.factor must be > 0 for type {self.type!r}, got {self.factor}")
        if self.type in ("llama3", "yarn") and self.original_max_position <= 0:
            raise ValueError(f"RopeConfig.original_max_position must be > 0 for type {self.type!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434): a cache of latent + shared rotary key per token.

    Attributes:
        q_lora_rank: rank of the query's low-rank projection (None: a full-rank query projection).
        kv_lora_rank: R, width of the compressed key/value latent.
        qk_nope_head_dim: per-head query/key dims without rotary embedding.
        qk_rope_head_dim: P, per-head query/key dims with rotary embedding (the key's shared across heads).
        v_head_dim: per-head value dims.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Mixture-of-Experts feed-forward with top-k routing (docs/moe.md); ValueError on inconsistent counts.

    Attributes:
        num_experts: E, routed experts per layer.
        num_experts_per_tok: k, experts each token is routed to (1 <= k <= E).
        expert_mlp_dim: F of each expert's gated MLP.
        num_shared_experts: experts every token also goes through (DeepSeek; 0: none).
        scoring: "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3, Kimi K2).
        norm_topk_prob: renormalize the k selected weights to sum to 1.
        routed_scaling_factor: the routed experts' output is multiplied by it (DeepSeek-V3: 2.5).
        num_groups: DeepSeek group-limited routing: experts in this many groups (1 disables it; divides E).
        topk_groups: tokens choose experts only within this many best groups.
        first_k_dense: the first k layers use a dense MLP of `dense_mlp_dim` (DeepSeek's first_k_dense_replace).
        dense_mlp_dim: F of those dense layers (> 0 when first_k_dense > 0).
        score_bias: aux-loss-free balancing (DeepSeek-V3 §2.1.2): a selection bias, += rate * sign(mean - load).
        bias_update_rate: that nudge's step size (0: frozen).
        aux_loss_coef: coefficient of the load-balancing auxiliary loss (Switch Transformer; 0: off).
        z_loss_coef: coefficient of the router z-loss (ST-MoE, Zoph et al. 2022; 0: off).
    """

    num_experts: int
    num_experts_per_tok: int
    expert_mlp_dim: int
    num_shared_experts: int = 0
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    first_k_dense: int = 0
    dense_mlp_dim: int = 0
    score_bias: bool = False
    bias_update_rate: float = 0.0
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEConfig.scoring={self.scoring!r}; expected softmax|sigmoid")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts}]")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"num_groups={self.num_groups} must divide num_experts={self.num_experts} and "
                             f"1 <= topk_groups={self.topk_groups} <= num_groups")
        if self.first_k_dense and self.dense_mlp_dim <= 0:
            raise ValueError("first_k_dense > 0 needs dense_mlp_dim > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters (Hu et al. 2021, arXiv:2106.09685): y = x W + (alpha / rank) (x A) B, with B starting at 0.

    Attributes:
        rank: the adapters' rank r (0: no adapters).
        alpha: the scale numerator (> 0): updates are scaled by alpha / rank.
        targets: the projection names adapted (`LORA_TARGETS`; never the routed experts).
    """

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __post_init__(self):
        if self.rank < 0 or self.alpha <= 0:
            raise ValueError(f"LoRAConfig: rank must be >= 0 and alpha > 0, got rank={self.rank}, alpha={self.alpha}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"LoRAConfig: targets {list(self.targets)}: {unknown or 'none'} are not projection "
                             f"names; each must be one of {LORA_TARGETS}")


# every projection `posttrain.model.layers.add_adapters` can adapt (GQA attention, MLA attention, MLPs)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "gate_proj", "up_proj",
                "down_proj")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer: embed -> scan(blocks) -> RMSNorm -> unembed.

    Raises ValueError on a non-positive dimension, heads not a multiple of kv heads, or an unknown name.

    Attributes:
        vocab_size: V, token ids.
        d_model: D, the residual width.
        num_layers: L, decoder blocks (scanned).
        num_heads: N, query heads.
        num_kv_heads: K, key/value heads (GQA groups N // K; N must be a multiple of K).
        head_dim: H, dims per head.
        mlp_dim: F of the dense gated MLP.
        norm_eps: RMSNorm epsilon.
        rope: rotary embedding (RopeConfig).
        max_position: the context length the checkpoint declares (HF max_position_embeddings).
        tie_embeddings: the unembedding is the embedding's transpose (no lm_head).
        qk_norm: RMSNorm on each head's queries and keys (Qwen3).
        attention_bias: biases on the q/k/v projections (Qwen2).
        mla: multi-head latent attention (MLAConfig) instead of GQA, or None.
        moe: Mixture-of-Experts feed-forward (MoEConfig), or None for dense.
        param_dtype: storage dtype of parameters.
        dtype: compute dtype of matmuls (softmax, norms and logits are float32).
        matmul_precision: "default" | "high" | "highest", applied to every dot (docs/precision.md).
        remat: what the backward keeps per scanned block: "none" | "dots" | "names" | "full" (docs/precision.md).
        remat_names: the activations kept under remat "names" (`layers.CHECKPOINT_NAMES`).
        lora: adapters added to the projections (LoRAConfig; None or rank 0: none).
        attention_impl: self-attention of long packed rows, one of `posttrain.model.attention_kernels.IMPLS`.
        grad_dtype: "param" or "compute": layer-matrix gradients in the compute dtype (docs/precision.md).
        moe_gmm_impl: the experts' grouped matmul, one of `posttrain.model.gmm.IMPLS` but "capacity".
        moe_capacity_factor: 0 dropless; c > 0 gives each expert ceil(c * tokens * k / E) slots, drops the rest.
        moe_ep_capacity_factor: expert parallelism's capacity factor (> 0; `posttrain.model.moe.dispatch`).
        name: the architecture family, the HF model_type it exports to ("" unknown).
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    max_position: int = 8192
    tie_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    param_dtype: str = "float32"
    dtype: str = "float32"
    matmul_precision: str = "default"
    remat: str = "none"
    remat_names: tuple[str, ...] = ("attn_out", "mlp_in")
    lora: LoRAConfig | None = None
    attention_impl: str = "auto"
    grad_dtype: str = "param"
    moe_gmm_impl: str = "auto"
    moe_capacity_factor: float = 0.0
    moe_ep_capacity_factor: float = 2.0
    name: str = ""

    def __post_init__(self):
        for f in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"ModelConfig.{f} must be > 0, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        for f in ("param_dtype", "dtype"):
            if getattr(self, f) not in _DTYPES:
                raise ValueError(f"ModelConfig.{f}={getattr(self, f)!r}; expected one of {_DTYPES}")
        if self.remat not in REMAT_MODES:
            raise ValueError(f"ModelConfig.remat={self.remat!r}; expected one of {REMAT_MODES}")
        if self.matmul_precision not in PRECISIONS:
            raise ValueError(f"ModelConfig.matmul_precision={self.matmul_precision!r}; expected one of {PRECISIONS}")
        if self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"ModelConfig.grad_dtype={self.grad_dtype!r}; expected one of {GRAD_DTYPES}")
        from posttrain.model.attention_kernels import IMPLS as ATTENTION_IMPLS
        from posttrain.model.gmm import IMPLS

        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attention_impl={self.attention_impl!r}; expected one of {ATTENTION_IMPLS}")

        if self.moe_gmm_impl not in IMPLS or self.moe_gmm_impl == "capacity":
            raise ValueError(f"ModelConfig.moe_gmm_impl={self.moe_gmm_impl!r}; expected one of "
                             f"{tuple(i for i in IMPLS if i != 'capacity')} (capacity: set moe_capacity_factor)")
        if self.moe_capacity_factor < 0 or not self.moe_ep_capacity_factor > 0:
            raise ValueError(f"ModelConfig.moe_capacity_factor={self.moe_capacity_factor} (>= 0, 0: dropless), "
                             f"moe_ep_capacity_factor={self.moe_ep_capacity_factor} (> 0)")
        bad = set(self.remat_names) - set(REMAT_NAMES)
        if bad:
            raise ValueError(f"ModelConfig.remat_names has unknown names {sorted(bad)}; known: {REMAT_NAMES}")
        if self.moe is not None and self.moe.first_k_dense > self.num_layers:
            raise ValueError(f"moe.first_k_dense={self.moe.first_k_dense} > num_layers={self.num_layers}")

    @property
    def num_dense_layers(self) -> int:
        """Layers with a dense MLP (all of them without MoE; the first k with MoE)."""
        return self.num_layers if self.moe is None else self.moe.first_k_dense

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers
