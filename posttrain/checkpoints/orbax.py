"""Train-state checkpoints: a thin wrapper over orbax `CheckpointManager` (async save, keep-last-K, resume).

Dimension legend: none (whole pytrees; array shapes are whatever the train state holds).

One step directory `<directory>/<step>/` holds three orbax items, written together and committed atomically
(orbax writes into `<step>.orbax-checkpoint-tmp*`, then writes `commit_success.txt` and renames):
  state/     the train state's arrays (orbax StandardSave: OCDBT/zarr3, one shard per process), as a nested
             dict keyed by the pytree path components (`params/layers/attn/q_proj/value`, ...).
  meta/      the caller's JSON dict: data/task cursor, run config, RNG stream position, ... (JsonSave).
  manifest/  JSON written by this module: format version, step, and one record per array leaf
             {path, shape, dtype, [key_impl], [variable]} used to check a restore target before reading.

How the pytree is stored:
  * The tree is flattened with `jax.tree_util` paths, so any pytree works (flax struct dataclasses, optax
    states, nnx `State`s, None subtrees). An nnx `Variable` is a pytree node: its array is the leaf at
    `<path>/value`; its type (`Param`, `ExpertBias`, ...) is recorded in the manifest and checked on restore;
    its metadata (`logical_axes`, ...) is NOT stored: it comes back from the restore target's tree definition,
    together with the structure. Restored trees therefore have exactly the target's treedef.
  * Typed PRNG keys (`jax.random.key`) are stored as `jax.random.key_data` (uint32) with the impl name in the
    manifest, and restored with `jax.random.wrap_key_data(..., impl=...)` in the target's sharding.

Async safety (the train step donates the state): in orbax 0.12.8, `save` blocks until every array has been
transferred to host memory (`replica_slices.transfer_arrays_to_host`, no device-host byte limiter is set), and
only the file writes run in the background. On CPU the host copy may be a zero-copy view; XLA then declines to
donate a buffer with a live host view (the jitted step copies instead). Either way a donated or overwritten state
after `save` returns cannot change what is written (tested). At most one save is in flight: the next `save`,
`wait`, `restore` and `close` first wait for it.

Completeness: a step counts (`all_steps`, `latest_step`) only once its directory is final (not a tmp name) and
contains orbax's `commit_success.txt`, `_CHECKPOINT_METADATA` and all three item directories. Partial tmp
directories (a `kill -9` mid-save) are ignored and removed when the next `Checkpointer` opens the directory.
`restore(None)` tries complete steps newest first; a step that fails to read (e.g. a truncated file) is logged as
an error, renamed to `<step>.corrupt-<unix time>` (never deleted) so the resumed run can write that step again, and
the next older step is tried; `unreadable` lists what was passed over (a `read_only` Checkpointer renames
nothing: readers of a run never change it). Data that still decodes after bit rot is
not detected (no checksums). keep-last-K: orbax deletes older steps only after the newer one is committed.
Multi-host: every process must call save/restore (orbax synchronises); the fallback
decision is taken per process from a shared filesystem, which assumes all processes see the same corruption.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

__all__ = ["Checkpointer", "CheckpointCorruptError", "CheckpointStructureError"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ITEMS = ("state", "meta", "manifest")
_COMMIT_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA")
_MAX_LISTED = 8


class CheckpointStructureError(ValueError):
    """The restore target's pytree does not match the checkpoint (paths, shapes, dtypes, Variable types)."""


class CheckpointCorruptError(ValueError):
    """A checkpoint exists but cannot be read (truncated/corrupt files), or no complete one is usable."""


# ------------------------------------------------------------------------------------------ pytree <-> storage
def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _components(path) -> tuple[str, ...]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            raise TypeError(f"unsupported pytree key {k!r} in path {jax.tree_util.keystr(path)}")
    return tuple(out)


def _leaves(tree) -> tuple[list[tuple[tuple[str, ...], Any, str | None]], Any]:
    """[(path components, leaf, enclosing nnx.Variable type name or None)] in flatten order, and the treedef."""
    out = []
    nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, node in nodes:
        if isinstance(node, nnx.Variable):
            for sub, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
                out.append((_components(path + sub), leaf, type(node).__name__))
        else:
            out.append((_components(path), node, None))
    treedef = jax.tree_util.tree_structure(tree)
    if len(out) != treedef.num_leaves:  # a Variable that flattens differently from a plain pytree walk
        raise TypeError(f"could not enumerate the leaves of the state ({len(out)} != {treedef.num_leaves})")
    return out, treedef


def _record(comps, leaf, var) -> dict:
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        raise TypeError(f"state leaf {'/'.join(comps)} is a {type(leaf).__name__}, not an array; "
                        "checkpointed leaves must be jax/numpy arrays (or ShapeDtypeStructs in a target)")
    rec = {"path": "/".join(comps), "shape": list(leaf.shape), "dtype": str(leaf.dtype)}
    if _is_key(leaf):
        rec["key_impl"] = str(jax.random.key_impl(leaf)) if isinstance(leaf, jax.Array) else None
    if var is not None:
        rec["variable"] = var
    return rec


def _nest(items: list[tuple[tuple[str, ...], Any]]) -> dict:
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


def _get(nested: dict, comps):
    for c in comps:
        nested = nested[c]
    return nested


def _key_data_sharding(sharding, name: str):
    if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    if isinstance(sharding, jax.sharding.NamedSharding):  # trailing key-data dim unsharded
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec))
    raise TypeError(f"PRNG key leaf {name} has a {type(sharding).__name__}; use a NamedSharding")


def _check_structure(saved: list[dict], wanted: list[dict], where: str):
    """Raises CheckpointStructureError listing every difference between the saved and wanted leaf records."""
    s, w = {r["path"]: r for r in saved}, {r["path"]: r for r in wanted}
    problems = []
    missing, extra = [p for p in w if p not in s], [p for p in s if p not in w]
    if missing:
        problems.append(f"in the target but not in the checkpoint: {missing[:_MAX_LISTED]}"
                        + (f" (+{len(missing) - _MAX_LISTED} more)" if len(missing) > _MAX_LISTED else ""))
    if extra:
        problems.append(f"in the checkpoint but not in the target: {extra[:_MAX_LISTED]}"
                        + (f" (+{len(extra) - _MAX_LISTED} more)" if len(extra) > _MAX_LISTED else ""))
    for p in w:
        if p in s:
            for field in ("shape", "dtype", "variable"):
                if s[p].get(field) != w[p].get(field):
                    problems.append(f"{p}: {field} {s[p].get(field)} in the checkpoint, "
                                    f"{w[p].get(field)} in the target")
    if problems:
        raise CheckpointStructureError(f"restore target does not match checkpoint {where}:\n  " + "\n  ".join(
            problems[:3 * _MAX_LISTED]))


# ---------------------------------------------------------------------------------------------- manager
class Checkpointer:
    """Saves/restores `(train state pytree, JSON meta dict)` under `directory/<step>/`.

    Args:
      directory: root directory (local path or any path orbax/epath supports, e.g. gs://); created if missing.
      every_steps: `should_save(step)` is True when `step % every_steps == 0` (step 0 included) and that step
        is not saved yet. Must be >= 1.
      keep: number of most recent steps kept (older ones are deleted after a newer save completes). >= 1.
      async_save: write files in a background thread (`save` returns after the device-to-host copy).
      read_only: for readers next to a running trainer (evaluation): never writes, renames or deletes
        anything (no tmp cleanup, no quarantine); `save` raises ValueError.
      best_metric: a key of the `metrics` some saves carry: the checkpoint with its highest value is kept in
        addition to the `keep` newest (orbax's BestN beside LatestN; ties: the later step). None: only the newest.
    Raises:
      ValueError: every_steps < 1 or keep < 1.
    Use as a context manager, or call `close()`, so the last async save is committed before exit.
    """

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
        policy = ocp.checkpoint_managers.LatestN(n=self.keep)
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
    def save(self, step: int, state, meta: dict, *, force: bool = False, metrics: dict | None = None) -> bool:
        """Starts saving `state` (any pytree of arrays / typed keys) and `meta` (JSON dict) as `step`.

        Saves when `should_save(step)` or `force` (e.g. the final step); a step that already exists is never
        overwritten (returns False). With async_save, returns once the arrays are on the host; the state may then
        be donated or modified. `metrics` ({name: float}) rank it for `best_metric`. Returns True when a save was
        started.
        Raises:
          TypeError: meta is not a JSON-serialisable dict, or a state leaf is not an array.
          ValueError: step < 0, or the Checkpointer is read-only.
        """
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
        if step in self._mngr.all_steps() or (not force and not self.should_save(step)):
            return False
        leaves, _ = _leaves(state)
        records = [_record(c, leaf, v) for c, leaf, v in leaves]
        stored = _nest([(c, jax.random.key_data(x) if _is_key(x) else x) for c, x, _ in leaves])
        manifest = {"format": FORMAT_VERSION, "step": step, "leaves": records}
        self._mngr.save(step, force=True, metrics=metrics, args=ocp.args.Composite(
            state=ocp.args.StandardSave(stored), meta=ocp.args.JsonSave(meta),
            manifest=ocp.args.JsonSave(manifest)))
        return True

    # ----------------------------------------------------------------------------------------- restore
    def restore(self, step: int | None, target_state) -> tuple[Any, dict]:
        """Reads `(state, meta)` at `step` (None: the newest usable step).

        `target_state` gives the structure and placement: a live state or its abstract twin (e.g.
        `jax.eval_shape` / `nnx.eval_shape` output with `jax.ShapeDtypeStruct(..., sharding=...)` leaves).
        Each array comes back with the target leaf's sharding (no sharding: the first local device); the
        result has the target's treedef (so nnx Variable types and metadata are the target's). `meta` is the
        saved dict after a JSON round trip (tuples become lists). `self.restored_step` is set to the step read.
        With step=None (and not read_only), unreadable or incomplete step dirs newer than the one restored are
        renamed `<step>.corrupt-<time>`, so the resumed run can save those steps again; `self.unreadable` lists
        them (read_only: left in place, moved_to None).
        Raises:
          FileNotFoundError: no complete checkpoint (or not `step`) in the directory (lists the steps found).
          CheckpointStructureError: target paths/shapes/dtypes/Variable types differ from the checkpoint.
          CheckpointCorruptError: `step` (or, for None, every complete step) cannot be read; names the
            directory and each step's error.
        """
        self._mngr.wait_until_finished()
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
        leaves, treedef = _leaves(target_state)
        wanted = [_record(c, leaf, v) for c, leaf, v in leaves]
        saved = {r["path"]: r for r in manifest["leaves"]}
        _check_structure(manifest["leaves"], wanted, where)

        abstract, keys = [], {}
        for (comps, leaf, _), rec in zip(leaves, wanted):
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            if _is_key(leaf):
                impl = saved[rec["path"]]["key_impl"]  # the saved impl must give the target's key dtype
                data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
                wrapped = jax.eval_shape(lambda d: jax.random.wrap_key_data(d, impl=impl), data)
                if wrapped.dtype != leaf.dtype:
                    raise CheckpointStructureError(f"{rec['path']}: key impl {impl} in checkpoint {where} gives "
                                                   f"{wrapped.dtype}, target has {leaf.dtype}")
                keys[comps] = (impl, sharding)
                abstract.append((comps, jax.ShapeDtypeStruct(data.shape, data.dtype,
                                                             sharding=_key_data_sharding(sharding, rec["path"]))))
            else:
                abstract.append((comps, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)))
        out = self._mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_nest(abstract)), meta=ocp.args.JsonRestore()))
        restored = []
        for comps, _, _ in leaves:
            x = _get(out["state"], comps)
            if comps in keys:
                impl, sharding = keys[comps]
                x = jax.device_put(jax.random.wrap_key_data(x, impl=impl), sharding)
            restored.append(x)
        self.restored_step = step
        return jax.tree_util.tree_unflatten(treedef, restored), dict(out["meta"] or {})

    def _quarantine(self, bad: list[dict]):
        """Renames unreadable step dirs (newer than the restored one) out of orbax's view, setting each record's
        "moved_to"; never deletes."""
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
