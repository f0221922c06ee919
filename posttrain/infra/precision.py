"""The precision policy: parameter (master) dtype, compute dtype and matmul precision, decided in one place.

  param_dtype       storage dtype of trainable parameters, and so of their gradients and Adam moments.
  compute_dtype     dtype of activations and matmul operands; every matmul accumulates in float32, and norms,
                    softmax, logprobs and the loss are float32 whatever this is.
  matmul_precision  "default" (the backend's default: on NVIDIA GPUs float32 matmuls run as TF32, relative error
                    ~3e-4 on an H200), "high" (bf16_3x / TF32 where available) or "highest" (true float32). Applied
                    to every dot of the model (forward, backward, sampler) and of the logprob computation.

`resolve_policy` turns config strings into a `PrecisionPolicy`, with "auto" meaning: on CPU float32 compute (the
reference numerics; CPUs without bf16 units run bf16 slower), on GPU/TPU bfloat16 compute; the master weights are
float32 unless asked otherwise (`param_dtype="bfloat16"` halves parameter, gradient and optimizer memory at the
cost of bf16 rounding in the update). Model presets describe checkpoints (their dtype fields say what the
file holds), not this training policy.
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
PRECISIONS = ("default", "high", "highest")
_LAX = {"high": jax.lax.Precision.HIGH, "highest": jax.lax.Precision.HIGHEST}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """A resolved precision policy (names, not dtype objects, so it is hashable and JSON-friendly). Raises
    ValueError on an unknown name.

    Attributes:
        param_dtype: dtype of the master weights (and of Adam's moments): one of DTYPES.
        compute_dtype: dtype of activations and matmul operands: one of DTYPES.
        matmul_precision: precision of every dot: one of PRECISIONS.
    """

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    matmul_precision: str = "default"

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(f"PrecisionPolicy.{field}={getattr(self, field)!r}; expected one of {tuple(DTYPES)}")
        if self.matmul_precision not in PRECISIONS:
            raise ValueError(f"PrecisionPolicy.matmul_precision={self.matmul_precision!r}; expected one of {PRECISIONS}")


def resolve_policy(compute_dtype: str = "auto", param_dtype: str = "auto", matmul_precision: str = "default",
                   backend: str | None = None) -> PrecisionPolicy:
    """The policy for these config values on `backend` (default: `jax.default_backend()`).

    "auto" compute dtype: float32 on "cpu", bfloat16 elsewhere. "auto" param dtype: float32.
    Raises ValueError on unknown names.
    """
    backend = backend or jax.default_backend()
    if compute_dtype == "auto":
        compute_dtype = "float32" if backend == "cpu" else "bfloat16"
    if param_dtype == "auto":
        param_dtype = "float32"
    return PrecisionPolicy(param_dtype=param_dtype, compute_dtype=compute_dtype, matmul_precision=matmul_precision)


def lax_precision(name: str | None):
    """`jax.lax.Precision` for "high" | "highest"; None for "default" or None (the backend's default).

    Raises ValueError on any other name.
    """
    if name in (None, "default"):
        return None
    if name not in _LAX:
        raise ValueError(f"matmul precision must be one of {PRECISIONS}, got {name!r}")
    return _LAX[name]


def matmul_scope(name: str | None):
    """A context under which every traced dot without an explicit precision gets `name` ("default": no change).

    Dots take their precision when traced, so wrapping a model call covers its forward pass, its autodiff
    backward (transposed dots keep the precision) and remat recomputation; custom-VJP backward rules are traced
    later and must pass `lax_precision(name)` explicitly.
    """
    lax_precision(name)  # validates
    return contextlib.nullcontext() if name in (None, "default") else jax.default_matmul_precision(name)
