"""The precision policy: parameter (master) dtype, compute dtype and matmul precision, decided in one place.

Matmuls accumulate in float32; norms, softmax, logprobs and the loss are float32. Design: docs/precision.md."""
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
    """A resolved precision policy, as names (hashable, JSON-friendly); raises ValueError on an unknown name.

    Attributes:
        param_dtype: dtype of the master weights (and of their gradients and Adam moments): one of DTYPES.
        compute_dtype: dtype of activations and matmul operands: one of DTYPES.
        matmul_precision: precision of every dot: one of PRECISIONS ("default": the backend's, TF32 on NVIDIA).
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
    """The policy for these config values on `backend`; "auto": float32 compute on CPU, bfloat16 elsewhere.

    "auto" param dtype: float32. Raises ValueError on unknown names."""
    backend = backend or jax.default_backend()
    if compute_dtype == "auto":
        compute_dtype = "float32" if backend == "cpu" else "bfloat16"
    if param_dtype == "auto":
        param_dtype = "float32"
    return PrecisionPolicy(param_dtype=param_dtype, compute_dtype=compute_dtype, matmul_precision=matmul_precision)


def lax_precision(name: str | None):
    """`jax.lax.Precision` for "high" | "highest"; None for "default" or None; ValueError for any other name."""
    if name in (None, "default"):
        return None
    if name not in _LAX:
        raise ValueError(f"matmul precision must be one of {PRECISIONS}, got {name!r}")
    return _LAX[name]


def matmul_scope(name: str | None):
    """A context giving traced dots without explicit precision `name`; custom-VJP backwards need `lax_precision`."""
    lax_precision(name)  # validates
    return contextlib.nullcontext() if name in (None, "default") else jax.default_matmul_precision(name)
