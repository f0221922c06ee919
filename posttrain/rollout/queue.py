"""The rollout queue: a producer thread runs the rollout phase (scheduler -> sampler -> environments -> scored
groups, `Rollouter.collect`) ahead of the learner by at most `max_staleness` policy versions.

Terms. Policy version v: the policy after v updates (`Learner.step`). Batch s: the rollouts of step s, trained by
update s + 1 while the learner is at version s. A batch is sampled under one version (the version of its oldest
token: every token of it), so its staleness is s - v. Admission control, as AReaL's (arXiv 2505.24298; its
capacity (max_staleness + version + 1) x batch size, here at batch granularity): the producer starts batch s only
once a version >= s - max_staleness is published, and samples it with the newest published one. Staleness is so
in [0, max_staleness] by construction (checked again when the learner takes a batch), and at most
max_staleness + 1 batches are ever ahead of the learner. At max_staleness = 0 the producer waits for version s
before batch s: the synchronous loop, through this same machinery.

Weights: the learner publishes each new version after its step (`publish`; `snapshot` times the copy,
perf/weight_sync_s). With the rollout engine (`Rollouter.engine`) every published version is also handed to it
(`EngineSampler.publish`); with `rollout.partial` (partial rollouts) it takes effect inside a generation under way,
at the engine's next decode chunk: a long reply continues under the new weights, each token tagged with the
version that produced it, and a batch counts as the version of its oldest token (`Trajectories.oldest_version`),
so its staleness is the largest of its tokens'. With max_staleness > 0 the published policy is a device copy: the
next update donates the learner's state, while the producer may still sample with the older version. At 0 no
copy is needed (the producer is done with version s before update s + 1 starts) and none is made. With split
meshes (`mesh.rollout`) the snapshot is the `sync` transfer instead: the version resharded onto the sampler's own
devices in its inference layout (`posttrain.infra.reshard.onto`), at any staleness (new arrays: the learner's
donation cannot touch them).

Sampler priority (`rollout.sampler_priority`, on by default; shared devices, max_staleness >= 1, no partial
rollouts): the learner's update does not start while the producer generates, or is about to (it has just queued
a batch, or the version it waits for has just been published, and generates next): `yield_to_sampler` blocks
until that generation call's outputs are computed. On shared cores (or one accelerator) an update started beside
a generation slows it, and the generation is the producer's critical path: in bench/async_rl.py's latency case
(2-core CPU) the learner, woken by each batch, started its update ~10 ms before the next generation, which then
took 0.44 s instead of 0.23 s. The producer never waits for the learner, so nothing can deadlock.

Process model: a thread (issue 24 item 5). The sampler is jitted JAX on the learner's own devices (a process
could not share them, and would need the weights serialised per version); XLA releases the GIL while it runs, and
env work runs in worker processes (`envs.pool`) or in short Python verifiers. Blocked on env latency, the producer
sits in `EnvPool._run`'s `multiprocessing.connection.wait` (a select, the GIL released, no polling; `get` below
blocks without a timeout too): a py-spy `--gil` profile (bench/async_rl.py's latency case, loaded 2-core CPU)
found it holding the GIL in 6 of 320 samples, and it used ~10 ms of CPU per batch (tokenizer, batching, archive
rows) against a 2 s env wait. What such a producer costs the learner is measured by the GIL-stall check
(`bench/async_rl.py` gil_stall; variants in `bench/_gil_stall.py`): the same producer as a thread and in its own
process (GIL not shared) against the learner alone, so thread / process is the GIL's part and process / alone
core sharing, which no process model removes. jax.distributed roles (a sampler process group) are the split-mesh
design (`mesh.rollout`), not a remedy for env waits. One process only when max_staleness > 0 (the run plan
refuses more): the producer's collectives (`HostShardedEnvs`) must not interleave with the learner's.

Resume: a checkpoint keeps the rollout state (scheduler cursors, retry queue, curriculum) as it was right after
the producer made the last batch the learner trained (`ReadyBatch.rollout_state`), so batches still queued at a
stop or kill -9 are dropped and their tasks re-sampled, in the same order, with the restored policy: a resumed
run never trains a sample older than the bound (the archive's `policy_version` column shows it).

Dimension legend: see `posttrain.types`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from typing import Any, Callable

import jax

from posttrain.rollout.rollouter import Rollouter, Trajectories

JOIN_TIMEOUT_S = 60.0  # how long `close` waits for a rollout in progress before it leaves the thread behind


class StalenessError(RuntimeError):
    """A batch would be trained further behind the policy than `max_staleness` allows (a bug: the producer's
    admission control makes it impossible); names the step, its version and the bound."""


@dataclasses.dataclass(frozen=True)
class ReadyBatch:
    """One produced batch. step: its step s; version: the policy version of its oldest sampled token (the version
    it was sampled with, or with partial rollouts the oldest a generation started under; each archive row's
    `policy_version` is its own sample's); trajectories: `Rollouter.collect`'s; rollout_state: the
    rollouter's state right after it (what a checkpoint after training it keeps); status: the run view then
    (`Rollouter.status`); wait_s / collect_s: the producer's seconds waiting for an admissible version before
    it, and collecting it."""

    step: int
    version: int
    trajectories: Trajectories
    rollout_state: dict
    status: dict
    wait_s: float
    collect_s: float

    def staleness(self) -> int:
        """Versions between the policy that sampled it and the one that trains it (step - version)."""
        return self.step - self.version


class RolloutQueue:
    """The producer thread and its queue of ready batches (see the module docstring). Built at the learner's
    version `start` with its policy states and PRNG key; produces batches start..steps-1. `sync`: the weight
    transfer of each version, tree -> the tree the producer samples with (split meshes: `reshard.onto` the
    sampler's submesh); None: a device copy when max_staleness > 0, else the tree itself. A context manager."""

    def __init__(self, rollouter: Rollouter, *, start: int, steps: int, policy: tuple, rng,
                 sync: Callable[[Any], Any] | None = None):
        self.rollouter, self.max_staleness = rollouter, int(rollouter.settings.queue_config.max_staleness)
        self._sync = sync
        self._cond = threading.Condition()
        self._busy = threading.Lock()  # held by the producer while it collects; `exclusive` takes it
        self._published = (start, self._copy((policy, rng)))
        self.partial = bool(rollouter.settings.queue_config.partial)
        self._engine = getattr(rollouter, "engine", None)  # the rollout engine's sampler, or None
        if self._engine is not None:
            self._engine.publish(self._published[1][0], start, live=False, keep=self.max_staleness + 1)
        self.sampler_priority = (bool(rollouter.settings.queue_config.sampler_priority) and sync is None
                                 and self.max_staleness > 0 and not self.partial)
        self._generating = 0  # generation calls in progress (sampler priority)
        self._gen_next = False  # the producer may generate its next batch and has not started yet
        self._awaiting: int | None = None  # the batch whose admissible version the producer waits for
        self._ready: dict[int, ReadyBatch] = {}
        self._error: BaseException | None = None
        self._stop = self._ended = False  # _ended: the producer thread has returned (set, notified, by itself)
        self._thread = threading.Thread(target=self._produce, args=(start, steps), name="posttrain-rollouts",
                                        daemon=True)
        self._thread.start()

    def _copy(self, tree):
        """`sync(tree)` when given; else a device copy of every array of `tree` when max_staleness > 0 (else `tree`
        itself)."""
        if self._sync is not None:
            return self._sync(tree)
        if self.max_staleness == 0:
            return tree
        return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)

    @property
    def version(self) -> int:
        """The newest published policy version."""
        return self._published[0]

    def _admissible(self, step: int) -> tuple[int, Any] | None:
        """Waits until a version >= step - max_staleness is published; None when stopping."""
        with self._cond:
            self._awaiting = step
            while not self._stop and self._published[0] < step - self.max_staleness:
                self._cond.wait()
            self._awaiting = None
            return None if self._stop else self._published

    def _produce(self, start: int, steps: int) -> None:
        r = self.rollouter
        try:
            for step in range(start, steps):
                t0 = time.perf_counter()
                got = self._admissible(step)
                if got is None:
                    return
                version, (policy, rng) = got
                t1 = time.perf_counter()
                with self._busy:
                    if self._stop:
                        return
                    try:
                        traj = r.collect(step, policy, rng, policy_version=version,
                                         gate=self.generating if self.sampler_priority else None)
                    finally:
                        self._gen_started()  # (no generation at all: the learner waits no longer)
                    version = version if traj.oldest_version is None else traj.oldest_version  # partial rollouts
                    state, status = json.loads(json.dumps(r.state_dict())), r.status(step, version)
                batch = ReadyBatch(step, version, traj, state, status,
                                   wait_s=t1 - t0, collect_s=time.perf_counter() - t1)
                with self._cond:
                    self._ready[step] = batch
                    # the learner takes this batch at once; the next generation starts about as soon: first
                    self._gen_next = (self.sampler_priority and step + 1 < steps
                                      and self._published[0] >= step + 1 - self.max_staleness)
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the learner, which raises it
            with self._cond:
                self._error = e
        finally:  # a learner waiting in `get` learns of it at once (it blocks without a timeout)
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    @contextlib.contextmanager
    def generating(self):
        """The producer's block around one generation call (until its outputs are computed): an update waiting
        in `yield_to_sampler` starts after it."""
        with self._cond:
            self._generating += 1
            self._gen_next = False
        try:
            yield
        finally:
            with self._cond:
                self._generating -= 1
                self._cond.notify_all()

    def _gen_started(self) -> None:
        with self._cond:
            if self._gen_next:
                self._gen_next = False
                self._cond.notify_all()

    def yield_to_sampler(self) -> float:
        """Sampler priority (`rollout.sampler_priority`, on shared devices at max_staleness >= 1 without partial
        rollouts; else returns 0 at once): blocks while a generation call is in progress, or about to start (the
        producer has just queued a batch and the next one's version is already published: without this the
        learner, woken by that batch, would start its update a few ms before the generation), so that the update
        the caller starts next does not slow it. Returns the seconds waited (perf/sampler_wait_s)."""
        if not self.sampler_priority:
            return 0.0
        t0 = time.perf_counter()
        with self._cond:
            while (self._generating or self._gen_next) and not self._ended and self._error is None:
                self._cond.wait()
        return time.perf_counter() - t0

    def get(self, step: int) -> tuple[ReadyBatch, float]:
        """(batch `step`, seconds the caller waited for it): blocks only while it is not ready. Raises what the
        producer raised (e.g. `EnvInfraError`), or StalenessError if the batch is beyond the bound."""
        t0 = time.perf_counter()
        with self._cond:
            while step not in self._ready and self._error is None and not self._ended:
                self._cond.wait()  # woken by a new batch, an error or the producer's end: no polling
            if step not in self._ready:
                if self._error is not None:
                    raise self._error
                raise RuntimeError(f"the rollout producer stopped before batch {step}")
            batch = self._ready.pop(step)
        if not 0 <= batch.staleness() <= self.max_staleness:
            raise StalenessError(f"batch {step} was sampled with policy version {batch.version}: staleness "
                                 f"{batch.staleness()} outside [0, rollout.max_staleness={self.max_staleness}]")
        return batch, time.perf_counter() - t0

    def snapshot(self, policy: tuple, rng) -> tuple[Any, float]:
        """((policy, rng) as the producer will use them, seconds it took): the `sync` transfer or a device copy
        when max_staleness > 0 (blocked until it is done), else the arrays themselves."""
        t0 = time.perf_counter()
        tree = self._copy((policy, rng))
        if self.max_staleness > 0 or self._sync is not None:
            jax.block_until_ready(tree)
        return tree, time.perf_counter() - t0

    def publish(self, version: int, tree) -> None:
        """Makes `tree` (a `snapshot`) the newest policy, of version `version`; wakes a waiting producer."""
        with self._cond:
            self._published = (int(version), tree)
            if self.sampler_priority and self._awaiting is not None:  # it generates as soon as it wakes: first
                self._gen_next = self._gen_next or version >= self._awaiting - self.max_staleness
            self._cond.notify_all()
        if self._engine is not None:  # partial rollouts: into the generation under way
            self._engine.publish(tree[0], version, live=self.partial, keep=self.max_staleness + 1)

    @contextlib.contextmanager
    def exclusive(self):
        """A block in which the producer does not run (it finishes the batch in progress first): the rollouter's
        env runner and scheduler are the caller's (held-out evaluation)."""
        with self._busy:
            yield

    def close(self) -> None:
        """Stops the producer: it starts no new batch; a batch in progress is waited for up to JOIN_TIMEOUT_S
        (then left behind with a warning); queued batches are dropped."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            from posttrain.infra.metrics import log

            log.warning("the rollout producer is still in a rollout after %.0f s; its batch is dropped",
                        JOIN_TIMEOUT_S)
        self._ready.clear()

    def __enter__(self) -> "RolloutQueue":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def batch_metrics(batch: ReadyBatch, learner_wait_s: float, step_s: float) -> dict[str, float]:
    """rollout/staleness_{mean,max} (over the batch's samples: one version per batch, so equal) and
    perf/idle_ratio_{train,rollout}: the learner's share of the step spent waiting for this batch, and the
    producer's share of its time on this batch spent waiting for an admissible version (seconds / seconds)."""
    s = float(batch.staleness())
    return {"rollout/staleness_mean": s, "rollout/staleness_max": s,
            "perf/idle_ratio_train": learner_wait_s / step_s if step_s > 0 else 0.0,
            "perf/idle_ratio_rollout": batch.wait_s / max(batch.wait_s + batch.collect_s, 1e-9)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """The `rollout` section.

    Attributes:
        max_staleness: the most policy versions a trained sample may lag the learner: the rollouts of step s
            (trained by update s + 1, the learner at version s) are sampled with a version v >= s - max_staleness,
            so the producer runs at most max_staleness + 1 batches ahead (0: every batch is sampled with the
            policy it trains, the synchronous loop exactly; AReaL's bound, arXiv 2505.24298). An int >= 0.
        stream_chunk: streaming scoring (`posttrain.generate.streaming`): every stream_chunk decode steps the samples
            that have finished decoding go to the env runner while the others still decode, so env time overlaps
            decoding; the samples, rewards and batches are the same as without it (0: off, the envs get a turn's
            samples once all have decoded). An int >= 0; one process only.
        partial: partial rollouts (issue 24 item 3): weights published by the learner while a batch still decodes
            go into the running rollout engine at its next decode chunk, so a long reply continues under the new
            policy instead of holding the batch back; each token records the version that produced it, a sample
            counts as its oldest token's version for staleness, and the loss corrects token by token (the
            sampler's logprob of each token is its behaviour policy). Needs max_staleness >= 1 and the
            rollout engine (sampling.backend "engine", or "auto" on one device; a ConfigError otherwise).
        sampler_priority: with max_staleness >= 1 on the learner's own devices, an update waits for a generation
            call in progress to end before it starts (`RolloutQueue.yield_to_sampler`; perf/sampler_wait_s), so
            the sampler, the producer's critical path, does not share the cores or the accelerator with an update
            it started beside; updates never delay a generation (a generation starting during an update runs
            beside it). Off (no effect) at max_staleness 0, with partial rollouts (a generation then spans
            updates by design) and with split meshes (`mesh.rollout`: the sampler has devices of its own).
    """

    max_staleness: int = 0
    stream_chunk: int = 0
    partial: bool = False
    sampler_priority: bool = True

    def __post_init__(self):
        v = self.max_staleness
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"rollout.max_staleness={v!r}: an int >= 0 (0: synchronous)")
        v = self.stream_chunk
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"rollout.stream_chunk={v!r}: an int >= 0 (decode steps between deliveries; 0: off)")
        if not isinstance(self.sampler_priority, bool):
            raise ValueError(f"rollout.sampler_priority={self.sampler_priority!r}: True or False")
        if self.partial and self.max_staleness < 1:
            raise ValueError(f"rollout.partial=True needs rollout.max_staleness >= 1 (weights that change during a "
                             f"batch make it off-policy), got {self.max_staleness}")
