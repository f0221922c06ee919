"""Weight transfer between split meshes: the learner trains on one set of devices in its train layout (FSDP, ...),
the rollout sampler decodes on a disjoint submesh in its inference layout (`mesh.rollout`: tensor- and
expert-parallel, no FSDP). Each policy version crosses once, learner -> rollout devices.

Both layouts come from the same logical-axis rules (`posttrain.infra.mesh.RULES` with the run's overlays): a
parameter's target sharding is its logical axes mapped onto the rollout mesh (`mesh.state_shardings`), whose
`fsdp` axis has size 1, so what FSDP splits in training is whole on each rollout device. Anything else in the
tree (a PRNG key) is replicated.
`jax.device_put` moves the arrays (XLA copies each destination shard from a source device that holds it).

Terms: source devices S (the learner's), destination mesh R (the rollout's), a leaf x of `nbytes` bytes whose
target sharding splits it into shards of `shard_bytes` each, one shard per device of R. Transfer bytes per
version = sum over leaves of shard_bytes(x) x |devices of R not in S| (the bytes written onto devices that did
not hold the array; disjoint meshes: every destination shard, replicas included).
"""
from __future__ import annotations

import math
from typing import Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from posttrain.infra import mesh as mesh_lib


def on_devices(tree, devices: Iterable[jax.Device]) -> bool:
    """Whether every committed jax.Array leaf of `tree` lives exactly on `devices` (an uncommitted one, e.g. a
    fresh `jax.random.key`, goes wherever the computation that uses it runs)."""
    want = set(devices)
    return all(set(x.sharding.device_set) == want for x in jax.tree.leaves(tree)
               if isinstance(x, jax.Array) and x.committed)


def onto(tree, mesh: Mesh, rules=mesh_lib.RULES):
    """`tree` resharded onto `mesh` in the inference layout (`mesh.state_shardings` on `mesh`: the target
    shardings, a pure function of shapes and logical axes; raises ValueError naming a parameter whose dimension
    does not divide the rollout mesh), moved by `jax.device_put` (asynchronous:
    block on the result to time it); `tree` itself when its arrays already live on the mesh's devices (the
    sampler sharing the learner's mesh keeps the train layout)."""
    if on_devices(tree, mesh.devices.flat):
        return tree
    return jax.device_put(tree, mesh_lib.state_shardings(tree, mesh, rules))


def _itemsize(dtype) -> int:
    return 8 if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else np.dtype(dtype).itemsize


def transfer_bytes(tree, shardings, source_devices: Iterable[jax.Device]) -> int:
    """Bytes one resharding of `tree` (arrays or ShapeDtypeStructs) to `shardings` (`mesh.state_shardings`' tree)
    writes onto devices outside `source_devices` (the module doc's count: each destination shard on each new
    device, replicas included). Raises ValueError when the two trees differ in structure."""
    src = set(source_devices)
    leaves, dst = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    if len(leaves) != len(dst):
        raise ValueError(f"transfer_bytes: {len(leaves)} arrays but {len(dst)} shardings")
    total = 0
    for x, s in zip(leaves, dst):
        total += math.prod(s.shard_shape(x.shape)) * _itemsize(x.dtype) * len(set(s.device_set) - src)
    return total
