"""Sharding helpers used inside traced code: logical constraints, sharded creation, sufficiency checks.

Without an active mesh (`jax.set_mesh`) every helper is a no-op."""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from posttrain.infra import mesh as mesh_lib
_RULES = contextvars.ContextVar("posttrain_sharding_rules", default=mesh_lib.RULES)


@contextlib.contextmanager
def use_rules(rules):
    """Makes `rules` (a RULES-like table) the ones `with_logical_constraint` uses, within the block."""
    token = _RULES.set(tuple(rules))
    try:
        yield
    finally:
        _RULES.reset(token)


def current_rules():
    return _RULES.get()


def active_mesh():
    """The abstract mesh set by `jax.set_mesh`, or None when no (non-trivial) mesh is active."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def with_logical_constraint(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` from logical axis names; dimensions that do not divide the mesh stay replicated."""
    mesh = active_mesh()
    if mesh is None:
        return x
    spec = mesh_lib.logical_to_spec(logical_axes, current_rules())
    fixed = []
    for size, axes in zip(x.shape, tuple(spec) + (None,) * (x.ndim - len(spec))):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        n = math.prod(mesh.shape[a] for a in names)
        fixed.append(axes if n > 1 and size % n == 0 else None)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*fixed))


def create_sharded(init_fn, mesh, rules=mesh_lib.RULES):
    """Runs a module constructor so that its parameters are born sharded.

    `init_fn()` must build and return an nnx Module. The abstract shapes are traced with `nnx.eval_shape`,
    mapped to NamedShardings through `rules`, then a jitted init with those `out_shardings` materialises the
    state directly on the devices (no host copy of the full model ever exists).

    Returns:
      (graphdef, state): the nnx functional boundary.
    Raises:
      ValueError: a parameter dimension does not divide the mesh (names the parameter).
    """
    from flax import nnx

    abstract = nnx.eval_shape(init_fn)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = mesh_lib.state_shardings(abstract_state, mesh, rules)

    def init():
        return nnx.state(init_fn())

    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)()
    return graphdef, state


def assert_sufficiently_sharded(state, mesh, min_fraction: float = 0.5, min_size: int = 1 << 16):
    """Raises AssertionError when under `min_fraction` of the elements of arrays of >= `min_size` are sharded."""
    if mesh.size == 1:
        return
    total = sharded = 0
    for leaf in jax.tree.leaves(state):
        if not hasattr(leaf, "sharding") or leaf.size < min_size:
            continue
        total += leaf.size
        if isinstance(leaf.sharding, NamedSharding) and any(s is not None for s in leaf.sharding.spec):
            sharded += leaf.size
    if total and sharded / total < min_fraction:
        raise AssertionError(f"only {sharded / total:.0%} of large parameter elements are sharded on mesh "
                             f"{dict(mesh.shape)} (wanted >= {min_fraction:.0%}); check the sharding rules")
