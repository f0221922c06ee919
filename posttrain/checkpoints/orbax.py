"""Train-state checkpoints: a thin wrapper over orbax `CheckpointManager` (async save, keep-last-K, resume).

Dimension legend: none (whole pytrees; array shapes are whatever the train state holds).

One step directory `<directory>/<step>/` holds three orbax items, written together and committed atomically
(orbax writes into `<step>.orbax-checkpoint-tmp*`, then writes `commit_success.txt` and renames):
  state/     the train state's arrays (orbax StandardSave: OCDBT/zarr3, one shard per process), as a nested
             dict keyed by the pytree path components (`params/layers/attn/q_proj/value`, ...).
  meta/      the caller's JSON dict: data/task cursor, run config, RNG stream position, ... (JsonSave).
  manifest/  JSON written by this module: format version, step, and one record per array leaf
             {path, shape, dtype, [key_impl], [variable], checksum} used to check a restore target before
             reading and what was read after.

How the pytree is stored: `posttrain.checkpoints.stored_tree`.

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
nothing: readers of a run never change it). Bit rot that still decodes is caught the same way: the manifest holds
each array's content checksum (`posttrain.checkpoints.checksum`), checked after every read (checkpoints written
before checksums restore unchecked). keep-last-K: orbax deletes older steps only after the newer one is committed; guard
checkpoints (`save(guard=True)`: the learner's step boundaries after a long step) never count toward K: one is kept
only while it is the newest (`_Retention`).
Multi-host: every process must call save/restore (orbax synchronises); the fallback
decision is taken per process from a shared filesystem, which assumes all processes see the same corruption.
"""
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

from posttrain.checkpoints import checksum
from posttrain.errors import AT_LEAST_ONE, POSITIVE, check_fields
from posttrain.checkpoints.stored_tree import (CheckpointStructureError, check_structure, flat_leaves, get_nested,
                                              is_key, key_data_sharding, leaf_record, nest)

__all__ = ["CheckpointConfig", "Checkpointer", "CheckpointCorruptError", "CheckpointStructureError"]

log = logging.getLogger(__name__)


def _drop_read_only_notice(record: logging.LogRecord) -> bool:
    """orbax warns "Given directory is read only" at every read-only CheckpointManager: readers of a run (eval,
    sample, convert) open one on purpose, several times a command."""
    return not str(record.msg).startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_drop_read_only_notice)


def _late_read_callback(unraisable) -> bool:
    """Whether an unraisable exception is a tensorstore read of an abandoned restore reporting back to its closed
    event loop: RuntimeError("Event loop is closed") raised by asyncio's `_check_closed`. When one array of a
    checkpoint fails to read, orbax's restore ends and closes its loop while reads of the other arrays are in
    flight; each of those then prints this traceback as it completes (up to one per array, harmless)."""
    e, tb = unraisable.exc_value, unraisable.exc_traceback
    if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed" and tb is not None):
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_name == "_check_closed"


def _quiet_late_read_callbacks() -> None:
    """Installs (once per process) an unraisable hook that drops `_late_read_callback`s and passes everything else
    to the hook before it; called before a restore, since a read can report back before the failure reaches us."""
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


# ---------------------------------------------------------------------------------------------- manager
class _Retention(ocp.checkpoint_managers.PreservationPolicy):
    """orbax preservation: the newest checkpoint, and the `n` newest of those whose step is not in `guards` (so a
    run of guard checkpoints never displaces the interval's; the checkpoints come in ascending step order)."""

    def __init__(self, n: int, guards: set):
        self.n, self.guards = n, guards

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        kept = {c.step for c in [c for c in checkpoints if c.step not in self.guards][-self.n:]}
        return [c.step in kept or i == len(checkpoints) - 1 for i, c in enumerate(checkpoints)]


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
    `guards`: the steps this Checkpointer saved with `guard=True` and not saved again since (forced, no guard).
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
        """Starts saving `state` (any pytree of arrays / typed keys) and `meta` (JSON dict) as `step`.

        Saves when `should_save(step)` or `force` (e.g. the final step); a step that already exists is never
        overwritten (returns False). With async_save, returns once the arrays are on the host; the state may then
        be donated or modified. `metrics` ({name: float}) rank it for `best_metric`. `guard` (with `force`): a
        guard checkpoint, kept only while newest; a save without it of a guard step makes the step a kept one
        (e.g. the final step). Returns True when a save was started.
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The `checkpoint` section (Orbax, under workdir/checkpoints).

    Attributes:
        every_steps: save interval in steps (the last step is always saved).
        keep: newest checkpoints kept.
        async_save: write in the background.
        stop_grace_s: seconds a run has after SIGINT / SIGTERM to finish its step and save it before it exits
            anyway (128 + signum); below the scheduler's kill deadline (TPU preemption ~30 s, Kubernetes
            terminationGracePeriodSeconds). A step boundary after a step of >= half of it is saved too (a guard
            checkpoint, `Learner.save`), so a step in flight past the grace never loses the last finished one.
    """

    every_steps: int = 10
    keep: int = 2
    async_save: bool = True
    stop_grace_s: float = 25.0

    def __post_init__(self):
        check_fields(self, ranges={"keep": AT_LEAST_ONE, "every_steps": AT_LEAST_ONE, "stop_grace_s": POSITIVE})
