"""How a checkpoint stores a train-state pytree (`posttrain.checkpoints.orbax` writes and reads it): the flat
leaf records of its manifest, the nested dict orbax writes, and the check of a restore target against them.

Dimension legend: none (whole pytrees; array shapes are whatever the train state holds).

* The tree is flattened with `jax.tree_util` paths, so any pytree works (flax struct dataclasses, optax
  states, nnx `State`s, None subtrees). An nnx `Variable` is a pytree node: its array is the leaf at
  `<path>/value`; its type (`Param`, `ExpertBias`, ...) is recorded in the manifest and checked on restore;
  its metadata (`logical_axes`, ...) is NOT stored: it comes back from the restore target's tree definition,
  together with the structure. Restored trees therefore have exactly the target's treedef.
* Typed PRNG keys (`jax.random.key`) are stored as `jax.random.key_data` (uint32) with the impl name in the
  manifest, and restored with `jax.random.wrap_key_data(..., impl=...)` in the target's sharding.
"""
from __future__ import annotations

from typing import Any

import jax
from flax import nnx

MAX_LISTED = 8  # paths listed per kind of structure difference


class CheckpointStructureError(ValueError):
    """The restore target's pytree does not match the checkpoint (paths, shapes, dtypes, Variable types)."""


def is_key(x) -> bool:
    """True for a typed PRNG key array (or its ShapeDtypeStruct)."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def components(path) -> tuple[str, ...]:
    """The string components of a `jax.tree_util` key path (dict keys, attribute names, sequence indices).
    Raises TypeError for another kind of key."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            raise TypeError(f"unsupported pytree key {k!r} in path {jax.tree_util.keystr(path)}")
    return tuple(out)


def flat_leaves(tree) -> tuple[list[tuple[tuple[str, ...], Any, str | None]], Any]:
    """[(path components, leaf, enclosing nnx.Variable type name or None)] in flatten order, and the treedef."""
    out = []
    nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, node in nodes:
        if isinstance(node, nnx.Variable):
            for sub, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
                out.append((components(path + sub), leaf, type(node).__name__))
        else:
            out.append((components(path), node, None))
    treedef = jax.tree_util.tree_structure(tree)
    if len(out) != treedef.num_leaves:  # a Variable that flattens differently from a plain pytree walk
        raise TypeError(f"could not enumerate the leaves of the state ({len(out)} != {treedef.num_leaves})")
    return out, treedef


def leaf_record(comps, leaf, var) -> dict:
    """The manifest record of one leaf (path, shape, dtype, [key_impl], [variable]). Raises TypeError for a leaf
    that is not an array."""
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        raise TypeError(f"state leaf {'/'.join(comps)} is a {type(leaf).__name__}, not an array; "
                        "checkpointed leaves must be jax/numpy arrays (or ShapeDtypeStructs in a target)")
    rec = {"path": "/".join(comps), "shape": list(leaf.shape), "dtype": str(leaf.dtype)}
    if is_key(leaf):
        rec["key_impl"] = str(jax.random.key_impl(leaf)) if isinstance(leaf, jax.Array) else None
    if var is not None:
        rec["variable"] = var
    return rec


def nest(items: list[tuple[tuple[str, ...], Any]]) -> dict:
    """A nested dict of [(path components, value)]. Raises ValueError when two paths collide."""
    root: dict = {}
    for comps, value in items:
        node = root
        for c in comps[:-1]:
            node = node.setdefault(c, {})
            if not isinstance(node, dict):
                raise ValueError(f"pytree paths collide at {'/'.join(comps)}")
        if comps[-1] in node:
            raise ValueError(f"pytree paths collide at {'/'.join(comps)} (keys equal as strings)")
        node[comps[-1]] = value
    return root


def get_nested(nested: dict, comps):
    """The value at path components `comps` of a nested dict."""
    for c in comps:
        nested = nested[c]
    return nested


def key_data_sharding(sharding, name: str):
    """The sharding of a PRNG key leaf's key data (its trailing dimension unsharded). Raises TypeError naming the
    leaf for a sharding other than a NamedSharding or SingleDeviceSharding."""
    if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    if isinstance(sharding, jax.sharding.NamedSharding):  # trailing key-data dim unsharded
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec))
    raise TypeError(f"PRNG key leaf {name} has a {type(sharding).__name__}; use a NamedSharding")


def check_structure(saved: list[dict], wanted: list[dict], where: str):
    """Raises CheckpointStructureError listing every difference between the saved and wanted leaf records."""
    s, w = {r["path"]: r for r in saved}, {r["path"]: r for r in wanted}
    problems = []
    missing, extra = [p for p in w if p not in s], [p for p in s if p not in w]
    if missing:
        problems.append(f"in the target but not in the checkpoint: {missing[:MAX_LISTED]}"
                        + (f" (+{len(missing) - MAX_LISTED} more)" if len(missing) > MAX_LISTED else ""))
    if extra:
        problems.append(f"in the checkpoint but not in the target: {extra[:MAX_LISTED]}"
                        + (f" (+{len(extra) - MAX_LISTED} more)" if len(extra) > MAX_LISTED else ""))
    for p in w:
        if p in s:
            for field in ("shape", "dtype", "variable"):
                if s[p].get(field) != w[p].get(field):
                    problems.append(f"{p}: {field} {s[p].get(field)} in the checkpoint, "
                                    f"{w[p].get(field)} in the target")
    if problems:
        raise CheckpointStructureError(f"restore target does not match checkpoint {where}:\n  " + "\n  ".join(
            problems[:3 * MAX_LISTED]))
