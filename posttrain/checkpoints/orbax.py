"""Train-state checkpoints over orbax `CheckpointManager`, and how a pytree is stored in one (docs/orbax.md)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from posttrain.checkpoints import checksum
from posttrain.errors import AT_LEAST_ONE, POSITIVE, check_fields

__all__ = ["CheckpointConfig", "Checkpointer", "CheckpointCorruptError", "CheckpointStructureError"]

log = logging.getLogger(__name__)


def _drop_read_only_notice(record: logging.LogRecord) -> bool:
    """Drops orbax's "Given directory is read only" notice: readers of a run open read-only managers on purpose."""
    return not str(record.msg).startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_drop_read_only_notice)


def _late_read_callback(unraisable) -> bool:
    """Whether an unraisable exception is "Event loop is closed" from a read of an abandoned (failed) restore."""
    e, tb = unraisable.exc_value, unraisable.exc_traceback
    if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed" and tb is not None):
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_name == "_check_closed"


def _quiet_late_read_callbacks() -> None:
    previous = sys.unraisablehook
    if getattr(previous, "_posttrain_late_reads", False):
        return

    def hook(unraisable):
        if not _late_read_callback(unraisable):
            previous(unraisable)

    hook._posttrain_late_reads = True
    sys.unraisablehook = hook

FORMAT_VERSION = 1
ITEMS = ("state", "meta", "manifest")
_COMMIT_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA")


class CheckpointCorruptError(ValueError):
    """A checkpoint exists but cannot be read (truncated/corrupt files), or no complete one is usable."""


# ------------------------------------------------------------------------------------------ stored tree
MAX_LISTED = 8  # paths listed per kind of structure difference


class CheckpointStructureError(ValueError):
    """The restore target's pytree does not match the checkpoint (paths, shapes, dtypes, Variable types)."""


def is_key(x) -> bool:
    """True for a typed PRNG key array (or its ShapeDtypeStruct)."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def components(path) -> tuple[str, ...]:
    """The string components of a `jax.tree_util` key path (keys, attributes, indices); TypeError for others."""
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
    """The manifest record of one leaf (path, shape, dtype, [key_impl], [variable]); TypeError for a non-array."""
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
    """The sharding of a PRNG key leaf's key data (trailing dim unsharded); TypeError for other sharding kinds."""
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


# ---------------------------------------------------------------------------------------------- manager
class _Retention(ocp.checkpoint_managers.PreservationPolicy):
    """Keeps the newest checkpoint and the `n` newest whose steps are not in `guards`."""

    def __init__(self, n: int, guards: set):
        self.n, self.guards = n, guards

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        kept = {c.step for c in [c for c in checkpoints if c.step not in self.guards][-self.n:]}
        return [c.step in kept or i == len(checkpoints) - 1 for i, c in enumerate(checkpoints)]


class Checkpointer:
    """Saves/restores `(train state pytree, JSON meta dict)` under `directory/<step>/` (docs/orbax.md).

    Close it (or use it as a context manager) so the last async save is committed. `keep`: newest steps kept, guard
    checkpoints not counted; `read_only`: never write, rename or delete; `best_metric`: a `metrics` key whose best
    step is kept too. Raises ValueError when every_steps or keep < 1."""

    def __init__(self, directory, *, every_steps: int, keep: int, async_save: bool = True,
                 read_only: bool = False, best_metric: str | None = None):
        if int(every_steps) < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        if int(keep) < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        directory = os.fspath(directory)
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        self.every_steps, self.keep, self.async_save = int(every_steps), int(keep), bool(async_save)
        self.read_only = bool(read_only)
        self.restored_step: int | None = None  # the step the last `restore` actually read
        # steps the last `restore(None)` passed over: {"step", "error", "moved_to" (None: left in place)}
        self.unreadable: list[dict] = []
        self.guards: set[int] = set()
        policy = _Retention(self.keep, self.guards)
        if best_metric:
            policy = ocp.checkpoint_managers.AnyPreservationPolicy([policy, ocp.checkpoint_managers.BestN(
                get_metric_fn=lambda m: m[best_metric], n=1, keep_checkpoints_without_metrics=False)])
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, best_fn=(lambda m: m[best_metric]) if best_metric else None,
            enable_async_checkpointing=self.async_save, cleanup_tmp_directories=not self.read_only,
            create=not self.read_only, read_only=self.read_only)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    @property
    def _mngr(self) -> ocp.CheckpointManager:
        if self._manager is None:
            raise ValueError(f"Checkpointer for {self.directory} is closed")
        return self._manager

    # ----------------------------------------------------------------------------------------- queries
    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _is_complete(self, step: int) -> bool:
        d = epath.Path(self._step_dir(step))
        return all((d / f).exists() for f in _COMMIT_FILES) and all((d / i).is_dir() for i in ITEMS)

    def all_steps(self) -> list[int]:
        """Ascending steps of COMPLETE checkpoints (committed; an in-flight async save is not listed)."""
        return [s for s in sorted(self._mngr.all_steps()) if self._is_complete(s)]

    def latest_step(self) -> int | None:
        """The newest complete step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """True when `step % every_steps == 0` and `step` is neither saved nor being saved."""
        return int(step) % self.every_steps == 0 and int(step) not in self._mngr.all_steps()

    # -------------------------------------------------------------------------------------------- save
    def save(self, step: int, state, meta: dict, *, force: bool = False, metrics: dict | None = None,
             guard: bool = False) -> bool:
        """Starts saving `state` (a pytree of arrays / typed keys) and `meta` as `step`; True when a save started.

        Saves when `should_save(step)` or `force`, never over an existing step; with async_save it returns once the
        arrays are on the host (the state may then be donated). Raises TypeError for a meta that is no JSON-serialisable
        dict or a non-array leaf, ValueError for step < 0 or a read-only Checkpointer."""
        if self.read_only:
            raise ValueError(f"Checkpointer for {self.directory} is read-only; cannot save step {step}")
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        try:
            json.dumps(meta, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"meta is not JSON-serialisable: {e}") from e
        if step in self._mngr.all_steps() or not (force or self.should_save(step)):
            if force and not guard:  # e.g. the final save of a step a guard saved: a kept one from now on
                self.guards.discard(step)
            return False
        if guard:
            self.guards.add(step)
        leaves, _ = flat_leaves(state)
        records = [leaf_record(c, leaf, v) for c, leaf, v in leaves]
        arrays = [jax.random.key_data(x) if is_key(x) else x for _, x, _ in leaves]
        for rec, sums in zip(records, checksum.checksums(arrays)):  # before the state may be donated
            rec["checksum"] = sums
        stored = nest([(c, x) for (c, _, _), x in zip(leaves, arrays)])
        manifest = {"format": FORMAT_VERSION, "step": step, "leaves": records}
        self._mngr.save(step, force=True, metrics=metrics, args=ocp.args.Composite(
            state=ocp.args.StandardSave(stored), meta=ocp.args.JsonSave(meta),
            manifest=ocp.args.JsonSave(manifest)))
        return True

    # ----------------------------------------------------------------------------------------- restore
    def restore(self, step: int | None, target_state) -> tuple[Any, dict]:
        """Reads `(state, meta)` at `step` (None: the newest usable step, falling back past unreadable ones).

        Arrays come back with `target_state`'s shardings and treedef; content checksums are checked after every read.
        Raises FileNotFoundError without a complete checkpoint (or `step`), CheckpointStructureError when the target
        differs from the checkpoint, CheckpointCorruptError when `step` (None: every step) cannot be read."""
        self._mngr.wait_until_finished()
        _quiet_late_read_callbacks()
        steps = self.all_steps()
        if step is not None:
            if int(step) not in steps:
                raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory}; "
                                        f"complete steps: {steps}")
            try:
                return self._restore_step(int(step), target_state)
            except CheckpointStructureError:
                raise
            except Exception as e:
                raise CheckpointCorruptError(f"checkpoint {self._step_dir(int(step))} is unreadable: "
                                             f"{type(e).__name__}: {str(e)[:500]}") from e
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        failures, self.unreadable = [], []
        for s in reversed(steps):
            try:
                out = self._restore_step(s, target_state)
            except CheckpointStructureError:
                raise
            except Exception as e:  # corrupt / truncated files: fall back to the previous step
                log.error("checkpoint %s is unreadable (%s: %s); trying an older one",
                          self._step_dir(s), type(e).__name__, " ".join(str(e).split())[:300])
                failures.append(f"step {s}: {type(e).__name__}: {str(e)[:300]}")
                continue
            errors = dict(f.split(": ", 1) for f in failures)
            self.unreadable = [{"step": t, "error": errors.get(f"step {t}", "incomplete (no commit marker)"),
                                "moved_to": None} for t in sorted(self._mngr.all_steps()) if t > s]
            self._quarantine(self.unreadable)
            return out
        raise CheckpointCorruptError(f"no usable checkpoint in {self.directory}:\n  " + "\n  ".join(failures))

    def _restore_step(self, step: int, target_state):
        where = self._step_dir(step)
        manifest = self._mngr.restore(step, args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))["manifest"]
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
            raise ValueError(f"unknown manifest {str(manifest)[:200]} (expected format {FORMAT_VERSION})")
        leaves, treedef = flat_leaves(target_state)
        wanted = [leaf_record(c, leaf, v) for c, leaf, v in leaves]
        saved = {r["path"]: r for r in manifest["leaves"]}
        check_structure(manifest["leaves"], wanted, where)

        abstract, keys = [], {}
        for (comps, leaf, _), rec in zip(leaves, wanted):
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            if is_key(leaf):
                impl = saved[rec["path"]]["key_impl"]  # the saved impl must give the target's key dtype
                data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
                wrapped = jax.eval_shape(lambda d: jax.random.wrap_key_data(d, impl=impl), data)
                if wrapped.dtype != leaf.dtype:
                    raise CheckpointStructureError(f"{rec['path']}: key impl {impl} in checkpoint {where} gives "
                                                   f"{wrapped.dtype}, target has {leaf.dtype}")
                keys[comps] = (impl, sharding)
                abstract.append((comps, jax.ShapeDtypeStruct(data.shape, data.dtype,
                                                             sharding=key_data_sharding(sharding, rec["path"]))))
            else:
                abstract.append((comps, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)))
        out = self._mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(nest(abstract)), meta=ocp.args.JsonRestore()))
        read = [get_nested(out["state"], comps) for comps, _, _ in leaves]
        bad = checksum.mismatches([r["path"] for r in wanted], [saved[r["path"]].get("checksum") for r in wanted],
                                  checksum.checksums(read))
        if bad:  # bytes that decode but are not the ones written: as unreadable as a truncated file
            raise ValueError(f"content checksum mismatch in {len(bad)} array(s) of {where}, the first: {bad[0]}")
        restored = []
        for comps, _, _ in leaves:
            x = get_nested(out["state"], comps)
            if comps in keys:
                impl, sharding = keys[comps]
                x = jax.device_put(jax.random.wrap_key_data(x, impl=impl), sharding)
            restored.append(x)
        self.restored_step = step
        return jax.tree_util.tree_unflatten(treedef, restored), dict(out["meta"] or {})

    def _quarantine(self, bad: list[dict]):
        if not bad or self.read_only:
            return
        stamp = int(time.time())
        for rec in bad:
            rec["moved_to"] = f"{self._step_dir(rec['step'])}.corrupt-{stamp}"
        if jax.process_index() == 0:
            for rec in bad:
                log.error("moving unreadable checkpoint %s to %s", self._step_dir(rec["step"]), rec["moved_to"])
                epath.Path(self._step_dir(rec["step"])).rename(epath.Path(rec["moved_to"]))
        ocp.multihost.sync_global_processes("posttrain_checkpointer_quarantine")
        self._mngr.reload()

    # ------------------------------------------------------------------------------------------ lifecycle
    def wait(self):
        """Blocks until the in-flight save (if any) is committed; re-raises its error."""
        self._mngr.wait_until_finished()

    def close(self):
        """Waits for the in-flight save, then releases orbax's threads. Idempotent."""
        if self._manager is not None:
            manager, self._manager = self._manager, None
            try:
                manager.wait_until_finished()
            finally:
                manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc):
        self.close()


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The `checkpoint` section (orbax, under workdir/checkpoints).

    Attributes:
        every_steps: save interval in steps (the last step is always saved).
        keep: newest checkpoints kept.
        async_save: write in the background.
        stop_grace_s: seconds after SIGINT / SIGTERM to finish and save the step (docs/learner.md)."""

    every_steps: int = 10
    keep: int = 2
    async_save: bool = True
    stop_grace_s: float = 25.0

    def __post_init__(self):
        check_fields(self, ranges={"keep": AT_LEAST_ONE, "every_steps": AT_LEAST_ONE, "stop_grace_s": POSITIVE})
