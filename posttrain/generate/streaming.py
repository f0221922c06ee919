"""Streaming scoring: rows whose generation finished go to the env runner while the rest still decode (docs/engine.md).

One process only: the multi-process env runner exchanges results by collectives, which must not run from a thread.
Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

import itertools
import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np

_SINKS: dict[int, Callable] = {}
_IDS = itertools.count(1)
_LOCK = threading.Lock()


def emit(stream_id, finished_N, tokens_NxLg, lengths_N) -> None:
    """Inside a jitted decode loop: hands the rows to the host sink registered under `stream_id` (int32 scalar)."""
    from jax.experimental import io_callback

    io_callback(deliver, None, stream_id, finished_N, tokens_NxLg, lengths_N, ordered=False)


def deliver(stream_id, finished_N, tokens_NxLg, lengths_N) -> None:
    """Host side of `emit`: calls the sink of `stream_id` with NumPy copies (skipped once it is unregistered)."""
    with _LOCK:
        sink = _SINKS.get(int(stream_id))
    if sink is not None:
        sink(np.array(finished_N, bool), np.array(tokens_NxLg), np.array(lengths_N))


def register(sink: Callable) -> int:
    """Registers `sink(finished_N, tokens_NxLg, lengths_N)`; returns its stream id (for `sample(stream_id=)`)."""
    with _LOCK:
        i = next(_IDS) % (1 << 30)
        _SINKS[i] = sink
    return i


def unregister(stream_id: int) -> None:
    with _LOCK:
        _SINKS.pop(int(stream_id), None)


class TurnScorer:
    """Steps one turn's episodes in `runner`, from its own thread, as their rows finish (sink: `rows_finished`).

    indices: the env episode index of each sampler row; decode: row tokens (int32 [n]) -> the reply text."""

    def __init__(self, runner, indices: Sequence[int], decode: Callable[[np.ndarray], str]):
        self.runner, self.indices, self.decode = runner, list(indices), decode
        self.replies: dict[int, str] = {}
        self.results: dict[int, Any] = {}
        self.deliveries = self.streamed = 0
        self._error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None  # started by the first submission (none if sampling fails first)

    def rows_finished(self, finished_N, tokens_NxLg, lengths_N) -> None:
        """The sink: queues the newly finished rows (on the sampler's callback thread: no env work here)."""
        rows = [int(r) for r in np.flatnonzero(finished_N) if int(r) not in self.replies]
        if rows:
            self.deliveries += 1
            self.streamed += len(rows)
            self._submit(rows, tokens_NxLg, lengths_N)

    def _submit(self, rows: list[int], tokens_NxLg, lengths_N) -> None:
        for r in rows:
            self.replies[r] = self.decode(np.asarray(tokens_NxLg[r, :int(lengths_N[r])], np.int32))
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="posttrain-stream-scoring", daemon=True)
            self._thread.start()
        self._jobs.put(rows)

    def _work(self) -> None:
        while (rows := self._jobs.get()) is not None:
            if self._error is not None:
                continue
            try:
                out = self.runner.step([self.replies[r] for r in rows], [self.indices[r] for r in rows])
                self.results.update(zip(rows, out))
            except BaseException as e:  # noqa: BLE001 - re-raised by finish, on the caller's thread
                self._error = e

    def finish(self, tokens_NxLg, lengths_N) -> tuple[list[str], list]:
        """Submits the rows left, waits for every step; returns (replies, results) in row order.

        Raises the runner's error, or RuntimeError when a streamed reply differs from the final tokens'."""
        tokens_NxLg, lengths_N = np.asarray(tokens_NxLg), np.asarray(lengths_N)
        streamed = dict(self.replies)
        rest = [r for r in range(len(self.indices)) if r not in self.replies]
        if rest:
            self._submit(rest, tokens_NxLg, lengths_N)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error
        for r, reply in streamed.items():
            final = self.decode(np.asarray(tokens_NxLg[r, :int(lengths_N[r])], np.int32))
            if final != reply:
                raise RuntimeError(f"streamed row {r} changed after it finished: {reply!r} -> {final!r}")
        n = len(self.indices)
        return [self.replies[r] for r in range(n)], [self.results[r] for r in range(n)]
