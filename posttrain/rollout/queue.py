"""The rollout queue: a producer thread runs `Rollouter.collect` ahead of the learner by at most `max_staleness`
policy versions (staleness protocol, weights, sampler priority, resume: docs/rollout.md).

Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from typing import Any, Callable

import jax

from posttrain.infra.metrics import log
from posttrain.rollout.rollouter import Rollouter, Trajectories

JOIN_TIMEOUT_S = 60.0  # how long `close` waits for a rollout in progress before it leaves the thread behind


class StalenessError(RuntimeError):
    """A batch would be trained further behind the policy than `max_staleness` allows (a bug: admission control)."""


@dataclasses.dataclass(frozen=True)
class ReadyBatch:
    """One produced batch: `version` is its oldest token's policy version, `rollout_state` what a checkpoint keeps."""

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
    """The producer thread and its ready batches start..steps-1, from the learner's version `start`.

    `sync`: each version's transfer to the producer's devices (None: a device copy when max_staleness > 0)."""

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
        """`sync(tree)`; else a device copy of `tree`'s arrays when max_staleness > 0; else `tree` itself."""
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
        """Marks one generation call (until its outputs are computed): `yield_to_sampler` waits for it."""
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
        """Blocks while a generation runs or is about to (sampler priority); returns the seconds waited."""
        if not self.sampler_priority:
            return 0.0
        t0 = time.perf_counter()
        with self._cond:
            while (self._generating or self._gen_next) and not self._ended and self._error is None:
                self._cond.wait()
        return time.perf_counter() - t0

    def get(self, step: int) -> tuple[ReadyBatch, float]:
        """Returns (batch `step`, seconds waited for it); raises StalenessError or what the producer raised."""
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
        """Returns ((policy, rng) as the producer will use them, seconds the copy took, blocked until done)."""
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
        """A block in which the producer does not run (it finishes its batch first): for held-out evaluation."""
        with self._busy:
            yield

    def close(self) -> None:
        """Stops the producer, waiting up to JOIN_TIMEOUT_S for a batch in progress; queued batches are dropped."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():

            log.warning("the rollout producer is still in a rollout after %.0f s; its batch is dropped",
                        JOIN_TIMEOUT_S)
        self._ready.clear()

    def __enter__(self) -> "RolloutQueue":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def batch_metrics(batch: ReadyBatch, learner_wait_s: float, step_s: float) -> dict[str, float]:
    """rollout/staleness_{mean,max} and perf/idle_ratio_{train,rollout} (the shares spent waiting) of one batch."""
    s = float(batch.staleness())
    return {"rollout/staleness_mean": s, "rollout/staleness_max": s,
            "perf/idle_ratio_train": learner_wait_s / step_s if step_s > 0 else 0.0,
            "perf/idle_ratio_rollout": batch.wait_s / max(batch.wait_s + batch.collect_s, 1e-9)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """The `rollout` section.

    Attributes:
        max_staleness: the most policy versions a trained sample may lag the learner (>= 0; 0: synchronous).
        stream_chunk: decode steps between deliveries of finished samples to the env runner (0: off; one process).
        partial: partial rollouts: new weights enter the rollout engine mid-batch (needs max_staleness >= 1).
        sampler_priority: an update waits for a generation in progress (not at max_staleness 0, partial or split).
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
