"""Weight transfer from the learner's devices (train layout) to the sampler's submesh (inference layout, no FSDP).

Both layouts come from the logical-axis rules; docs/distributed.md."""
from __future__ import annotations

import math
from typing import Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from posttrain.infra import mesh as mesh_lib


def on_devices(tree, devices: Iterable[jax.Device]) -> bool:
    """Whether every committed jax.Array leaf of `tree` lives exactly on `devices` (uncommitted ones go anywhere)."""
    want = set(devices)
    return all(set(x.sharding.device_set) == want for x in jax.tree.leaves(tree)
               if isinstance(x, jax.Array) and x.committed)


def onto(tree, mesh: Mesh, rules=mesh_lib.RULES):
    """`tree` moved onto `mesh` in the inference layout (asynchronous), or `tree` itself when already on its devices.

    Raises ValueError naming a parameter whose dimension does not divide the rollout mesh."""
    if on_devices(tree, mesh.devices.flat):
        return tree
    return jax.device_put(tree, mesh_lib.state_shardings(tree, mesh, rules))


def _itemsize(dtype) -> int:
    return 8 if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else np.dtype(dtype).itemsize


def transfer_bytes(tree, shardings, source_devices: Iterable[jax.Device]) -> int:
    """Bytes one resharding of `tree` to `shardings` writes outside `source_devices` (replicas included).

    Raises ValueError when the two trees differ in structure."""
    src = set(source_devices)
    leaves, dst = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    if len(leaves) != len(dst):
        raise ValueError(f"transfer_bytes: {len(leaves)} arrays but {len(dst)} shardings")
    total = 0
    for x, s in zip(leaves, dst):
        total += math.prod(s.shard_shape(x.shape)) * _itemsize(x.dtype) * len(set(s.device_set) - src)
    return total
