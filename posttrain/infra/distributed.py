"""Multi-process (multi-host) runs through `jax.distributed`, and stop signals for training loops.

Data flow and the stop protocol: docs/distributed.md. With one process everything here is single-host behaviour."""
from __future__ import annotations

import os
import pickle

import jax
import numpy as np

from posttrain.infra.metrics import log

ENV_FLAG = "POSTTRAIN_DISTRIBUTED"
# jax.distributed.initialize's arguments -> the variables that give them (JAX reads the first itself)
SETTINGS_VARS = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
                 "process_id": "JAX_PROCESS_ID"}
AUTO_DETECTED = "Cloud TPU VMs, SLURM (srun), Open MPI (mpirun) and Kubernetes"  # jax._src.clusters


class DistributedSetupError(ValueError):
    """Distributed mode is on but a setting to join the peers is missing or malformed; names the variables to set."""


def initialize(enabled: bool | None = None, **kwargs) -> bool:
    """Calls `jax.distributed.initialize(**kwargs)` once when enabled (argument, or env POSTTRAIN_DISTRIBUTED=1).

    Outside `AUTO_DETECTED` clusters pass the settings or set `SETTINGS_VARS`; call before any JAX device use.
    Returns whether distributed mode is on. Raises DistributedSetupError for a missing or malformed setting,
    RuntimeError (from JAX) when the peers cannot be reached."""
    if enabled is None:
        enabled = os.environ.get(ENV_FLAG, "0") not in ("", "0", "false", "False")
    if not enabled:
        return False
    for key, var in SETTINGS_VARS.items():
        if key not in kwargs and os.environ.get(var):
            value = os.environ[var].strip()
            if key != "coordinator_address" and not value.isdigit():
                raise DistributedSetupError(f"{var}={value!r}: expected an integer >= 0")
            if key == "coordinator_address" and not value.rpartition(":")[2].isdigit():
                raise DistributedSetupError(f"{var}={value!r}: expected host:port (the address of process 0)")
            kwargs[key] = value if key == "coordinator_address" else int(value)
    if not jax.distributed.is_initialized():
        try:
            jax.distributed.initialize(**kwargs)
        except ValueError as e:  # JAX checks its settings before it contacts anyone: nothing was started
            missing = [var for key, var in SETTINGS_VARS.items() if kwargs.get(key) is None]
            how = (f"no cluster detected (JAX finds its peers by itself on {AUTO_DETECTED}): set "
                   f"{', '.join(missing)} in every process, e.g. JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 "
                   "JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 on the first host (launch/ has TPU pod, SLURM and "
                   "one-machine scripts)" if missing and "defined" in str(e) else
                   "given: " + ", ".join(f"{var}={kwargs.get(key)!r}" for key, var in SETTINGS_VARS.items()))
            raise DistributedSetupError(f"distributed mode (--distributed or {ENV_FLAG}=1): "
                                        f"{' '.join(str(e).split()).rstrip('.')}; {how}") from e
    return True


def is_main_process() -> bool:
    """True on process 0 (the one that writes metrics, plots and prints)."""
    return jax.process_index() == 0


def to_host(tree):
    """numpy copies of a pytree of arrays, the full value on every process (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def global_array(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global jax array with `sharding` from the full global value `x` held on every process."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def agree(flag: bool) -> bool:
    """Process 0's value of a host-side decision, so every process takes the same branch (a collective)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag, np.bool_)))


def host_share(n: int) -> range:
    """This process's contiguous block of `n` items, blocks in process order (sizes differ by at most one)."""
    count, index = jax.process_count(), jax.process_index()
    return range(n * index // count, n * (index + 1) // count)


def allgather_objects(obj) -> list:
    """Every process's picklable `obj`, in process order, on every process (collectives: all must call it)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    return [pickle.loads(rows[p, :int(sizes[p])].tobytes()) for p in range(len(sizes))]


# ----------------------------------------------------------------------------- stop signals
class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a training run (a KeyboardInterrupt); `signal_name` names the signal."""

    def __init__(self, signal_name: str, message: str = ""):
        super().__init__(message or f"{signal_name} received")
        self.signal_name = signal_name


class StopRequest:
    """A context manager taking SIGINT / SIGTERM as a request to stop a training loop soon (docs/distributed.md)."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self, grace_s: float = 25.0):
        import threading

        self.grace_s, self.signal_name = float(grace_s), None
        self._defer, self._old, self._wakeup = 0, {}, None
        self._done, self._main = threading.Event(), threading.current_thread() is threading.main_thread()

    def __enter__(self) -> "StopRequest":
        import signal
        import socket
        import threading

        if not self._main:
            return self
        for name in self.SIGNALS:
            self._old[name] = signal.signal(getattr(signal, name), self._handle)
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._wakeup = (reader, writer, signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False))
        threading.Thread(target=self._watchdog, args=(reader,), name="posttrain-stop-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        import signal

        self._done.set()
        if not self._main:
            return
        for name, old in self._old.items():
            signal.signal(getattr(signal, name), old)
        reader, writer, old_fd = self._wakeup
        signal.set_wakeup_fd(old_fd)
        writer.close()  # the watchdog's read returns
        self._old = {}

    def _handle(self, signum, frame) -> None:
        import signal

        name = signal.Signals(signum).name
        if self.signal_name is not None:
            raise KeyboardInterrupt(f"second {name}: stopping without saving")
        self.signal_name = name

        log.warning("%s: saving a checkpoint and stopping (send it again to stop at once, without saving)", name)
        if self._defer == 0 and jax.process_count() == 1:
            raise RunInterrupted(name)

    def _watchdog(self, reader) -> None:
        import signal
        import sys

        wanted = {int(getattr(signal, name)) for name in self.SIGNALS}
        with reader:
            while True:
                try:
                    data = reader.recv(64)
                except OSError:
                    return
                if not data or self._done.is_set():
                    return
                got = [b for b in data if b in wanted]
                if got:
                    break
        if not self._done.wait(self.grace_s):
            print(f"error: {signal.Signals(got[0]).name}: the run did not stop within {self.grace_s:g} s (a device "
                  "computation still running); exiting without a new checkpoint: the same command resumes from "
                  "the last one", file=sys.stderr, flush=True)
            os._exit(128 + got[0])

    def deferred(self):
        """A block a signal does not interrupt (with one process): RunInterrupted is raised when it ends."""
        import contextlib

        @contextlib.contextmanager
        def block():
            self._defer += 1
            try:
                yield
            finally:
                self._defer -= 1
            if self.signal_name is not None and self._defer == 0 and jax.process_count() == 1:
                raise RunInterrupted(self.signal_name)

        return block()

    def check(self) -> None:
        """Raises RunInterrupted when any process received a stop signal (a collective: every process calls it)."""
        if jax.process_count() == 1:
            flags = [self.signal_name]
        else:
            flags = allgather_objects(self.signal_name)
        name = next((f for f in flags if f is not None), None)
        if name is not None:
            raise RunInterrupted(name)
