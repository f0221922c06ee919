"""Device mesh and the one table mapping logical axes to mesh axes (docs/mesh.md)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from posttrain.errors import AT_LEAST_ONE, FieldError, check_fields

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# logical axis -> mesh axis (str), several mesh axes (tuple), or None (replicated).
RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp", "expert")),  # activations: every non-model axis splits the batch
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("exp", "expert"),
    ("exp_mlp", "tensor"),
    ("q_lora", None),
    ("kv_lora", None),
    ("layers", None),
    ("lora_rank", None),
)


def rules_with_overrides(overrides: Mapping[str, Any] | None = None, rules=RULES) -> tuple:
    """`rules` with some logical axes remapped (`{"embed": None}`: no FSDP); ValueError on an unknown name or axis."""
    table = dict(rules)
    for name, target in (overrides or {}).items():
        if name not in table:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(table)}")
        for ax in _as_tuple(target):
            if ax not in MESH_AXES:
                raise ValueError(f"rule {name!r} -> {target!r}: mesh axes are {MESH_AXES}")
        table[name] = target
    return tuple(table.items())


def _as_tuple(target) -> tuple[str, ...]:
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def mesh_shape(axis_sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Per-axis sizes, at most one -1, resolved to sizes whose product is `num_devices`; ValueError otherwise."""
    unknown = set(axis_sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; expected a subset of {MESH_AXES}")
    sizes = {ax: int(axis_sizes.get(ax, 1)) for ax in MESH_AXES}
    free = [ax for ax, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {free}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % known:
            raise ValueError(f"mesh {sizes}: {num_devices} devices are not divisible by {known}")
        sizes[free[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"mesh {sizes} has {math.prod(sizes.values())} slots but there are {num_devices} devices")
    return sizes


def make_mesh(axis_sizes: Mapping[str, int] | Any = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a `Mesh` over axes ("data", "fsdp", "tensor", "expert") with Auto axis types.

    Args:
      axis_sizes: mapping or object with attributes data/fsdp/tensor/expert (one may be -1 = the rest).
        None means all devices on `fsdp`.
      devices: defaults to `jax.devices()` (all processes' devices in a multi-host run).
    """
    devices = list(jax.devices() if devices is None else devices)
    if axis_sizes is None:
        axis_sizes = {"fsdp": -1}
    elif not isinstance(axis_sizes, Mapping):
        axis_sizes = {ax: getattr(axis_sizes, ax) for ax in MESH_AXES}
    sizes = mesh_shape(axis_sizes, len(devices))
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(tuple(sizes.values()), devices=devices)
    except Exception:  # non-physical topologies (fake CPU devices, odd shapes): plain reshape
        grid = np.asarray(devices, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def rollout_shape(rollout: int, tensor: int, expert: int, num_devices: int) -> dict[str, int] | None:
    """The rollout submesh's shape of `rollout` devices (None for 0); ValueError naming the mesh.* keys if no fit."""
    if not rollout:
        if (tensor, expert) != (-1, 1):
            raise ValueError(f"mesh.rollout_tensor={tensor} / mesh.rollout_expert={expert} shape the rollout "
                             "submesh: set mesh.rollout (its devices) too")
        return None
    if rollout >= num_devices:
        raise ValueError(f"mesh.rollout={rollout} leaves no learner devices of the {num_devices}")
    tp = rollout // expert if tensor == -1 else tensor
    if tp < 1 or rollout % (tp * expert):
        raise ValueError(f"mesh.rollout={rollout} does not divide into mesh.rollout_tensor={tensor} x "
                         f"mesh.rollout_expert={expert}")
    return {"data": rollout // (tp * expert), "fsdp": 1, "tensor": tp, "expert": expert}


def split_meshes(learner_shape: Mapping[str, int], rollout_shape: Mapping[str, int] | None,
                 devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, Mesh]:
    """(learner mesh, rollout mesh), the latter on the last devices (one mesh, twice, without `rollout_shape`).

    Raises ValueError when the shapes need more devices than there are, or for a split across processes."""
    devices = list(jax.devices() if devices is None else devices)
    if rollout_shape is None:
        mesh = make_mesh(learner_shape, devices)
        return mesh, mesh
    if jax.process_count() > 1:
        raise ValueError(f"mesh.rollout: a rollout submesh runs in one process only ({jax.process_count()} here)")
    n_learn, n_roll = math.prod(learner_shape.values()), math.prod(rollout_shape.values())
    if n_learn + n_roll > len(devices):
        raise ValueError(f"learner mesh {dict(learner_shape)} and rollout mesh {dict(rollout_shape)} need "
                         f"{n_learn} + {n_roll} devices, there are {len(devices)}")
    return make_mesh(learner_shape, devices[:n_learn]), make_mesh(rollout_shape, devices[len(devices) - n_roll:])


def logical_to_spec(logical_axes: Sequence[str | None] | None, rules=RULES) -> PartitionSpec:
    """The PartitionSpec of logical axis names, each mesh axis used once at most; ValueError for a name without rule."""
    if logical_axes is None:
        return PartitionSpec()
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name in logical_axes:
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
        axes = tuple(ax for ax in _as_tuple(table[name]) if ax not in used)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


class ShardingError(ValueError):
    """An array dimension does not divide over the mesh axes its sharding rule names (a user setting: exit code 2)."""


def check_divisible(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh, name: str = "array") -> None:
    """Raises ShardingError naming the array, dimension and mesh axes when a sharded dim does not divide."""
    for dim, (size, axes) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
        n = math.prod(mesh.shape[a] for a in _as_tuple(axes))
        if size % n:
            raise ShardingError(f"{name}: dimension {dim} of shape {tuple(shape)} has size {size}, which does not "
                             f"divide over mesh axes {axes} of total size {n} (mesh {dict(mesh.shape)}); "
                             "change the mesh or the sharding rules")


def variable_sharding(variable, mesh: Mesh, rules=RULES, path: str = "param") -> NamedSharding:
    """NamedSharding for one nnx Variable from its `logical_axes` metadata (replicated when absent)."""
    axes = variable.get_metadata().get("logical_axes")
    value = variable.get_value() if hasattr(variable, "get_value") else variable.value
    spec = logical_to_spec(axes, rules)
    if axes is not None and len(axes) != len(value.shape):
        raise ValueError(f"{path}: logical axes {axes} do not match shape {tuple(value.shape)}")
    check_divisible(value.shape, spec, mesh, path)
    return NamedSharding(mesh, spec)


def state_shardings(state, mesh: Mesh, rules=RULES):
    """Maps an nnx State (concrete or abstract) to a matching tree of NamedShardings."""
    from flax import nnx

    def one(path, v):
        if isinstance(v, nnx.Variable):
            return v.replace(variable_sharding(v, mesh, rules, jax.tree_util.keystr(path)))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_shards(mesh_shape: Mapping[str, int], rules=RULES) -> int:
    """Number of batch shards: the product of the mesh axes that the logical "batch" axis maps to under `rules`."""
    return math.prod(mesh_shape[a] for a in _as_tuple(logical_to_spec(("batch",), rules)[0]))


def batch_sharding(mesh: Mesh, ndim: int, rules=RULES) -> NamedSharding:
    """Sharding for a [batch, ...] activation/input array: batch split over the batch rule's axes."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The `mesh` section: per-axis device counts, one of which may be -1 (the remaining devices).

    Attributes:
        data: devices on the data-parallel axis.
        fsdp: devices on the fully-sharded data-parallel axis.
        tensor: devices on the tensor-parallel axis.
        expert: devices on the expert-parallel axis.
        rules: overlays of `RULES`: logical axis -> mesh axis, list of mesh axes, or None (replicated).
        rollout: devices of the rollout sampler's own submesh, the last ones (0: it shares the learner's). One process.
        rollout_tensor: tensor-parallel degree of the rollout submesh (-1: its devices / rollout_expert).
        rollout_expert: expert-parallel degree of the rollout submesh."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1
    rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rollout: int = 0
    rollout_tensor: int = -1
    rollout_expert: int = 1

    def __post_init__(self):
        axis = ("-1 (the remaining devices) or >= 1", lambda v: v == -1 or v >= 1)
        check_fields(self, ranges={**dict.fromkeys(("data", "fsdp", "tensor", "expert", "rollout_tensor"), axis),
                                   "rollout": (">= 0 (0: the sampler shares the learner's mesh)", lambda v: v >= 0),
                                   "rollout_expert": AT_LEAST_ONE})
        try:
            rules_with_overrides(self.rules)
        except (ValueError, TypeError) as e:
            raise FieldError("rules", dict(self.rules), f": {e}") from None
        free = [k for k in MESH_AXES if getattr(self, k) == -1]
        if len(free) > 1:
            raise ValueError(f"at most one axis may be -1, got {['mesh.' + k for k in free]}")

    def axis_sizes(self) -> dict[str, int]:
        """{mesh axis: devices} as configured (one may be -1)."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}
