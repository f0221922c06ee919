"""The GIL-stall check of bench/async_rl.py (issue 24 item 5; not a benchmark): the learner's update seconds alone
and next to a producer blocked on env latency, in three variants that separate the GIL from core sharing.

  sleep    a producer thread running `Rollouter.collect` (scheduler, tokenizer, batching, archive rows; a scripted
           sampler: no device work) whose env wait is a pure `time.sleep` in this process (`SleepEnvs`: the
           pool's wall time per step, no worker processes): the producer's own host work, under this process's GIL.
  thread   the same thread with the real env runner (`EnvPool` worker processes of the latency env): what the
           async loop's producer does while it waits on environments.
  process  the `thread` producer in a child process (this file run as a script: its own interpreter, GIL and JAX
           client): the same work on the same cores, the GIL not shared.
thread / process is the GIL's part (same work, same cores, one GIL or two); process / alone is core sharing (its
producer and env workers take CPU from the learner's XLA threads). Each variant also reports the CPU seconds per
batch its producer and its env workers used (the thread's CPU time / the child's process time; /proc for the workers),
counted from its first batch on (worker start-up and imports left out).

While "blocked on env latency" the producer thread sits in `multiprocessing.connection.wait` (`EnvPool._run`: a
select on the workers' sockets, the GIL released, no polling) between its batches' host work.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import threading
import time

VARIANTS = ("sleep", "thread", "process")
SKIPPED = ("mesh", "graphdef", "runner", "scheduler", "engine")  # Rollouter fields a producer copy sets itself


def scripted_sampler(tokenizer, reply: str = "The answer is 5."):
    """A sample_fn (prompts, lengths, key, G, on_rows=None) -> SampleOutput of `reply` + stop on every row: the
    producer's sampling without device work."""
    import numpy as np

    from posttrain.generate.sampler import SampleOutput

    ids = tokenizer.encode(reply) + [tokenizer.stop_ids[0]]

    def fn(prompts, lengths, key, group_size, on_rows=None):
        n = len(lengths) * group_size
        tokens = np.tile(np.asarray(ids, np.int32), (n, 1))
        return SampleOutput(tokens, np.full(tokens.shape, -0.5, np.float32), np.full(n, len(ids), np.int32),
                            np.zeros(n, bool))

    return fn


class SleepEnvs:
    """An EnvRunner of in-process envs whose wait is a pure `time.sleep`: each `step` sleeps latency_s x
    ceil(episodes / workers) seconds (an `EnvPool` of `workers` processes waiting latency_s per episode), then
    scores inline; episodes' `latency_s` kwarg is zeroed (the sleep replaces it)."""

    def __init__(self, latency_s: float, workers: int):
        from posttrain.rollout.episodes import InlineEnvs

        self.latency_s, self.workers, self.inline = float(latency_s), max(1, int(workers)), InlineEnvs()

    def reset(self, episodes):
        return self.inline.reset([dataclasses.replace(ep, env_kwargs={**ep.env_kwargs, "latency_s": 0.0})
                                  if "latency_s" in ep.env_kwargs else ep for ep in episodes])

    def step(self, actions, indices=None):
        time.sleep(self.latency_s * math.ceil(len(actions) / self.workers))
        return self.inline.step(actions, indices)

    def close(self):
        self.inline.close()


def producer_rollouter(fields: dict, runner):
    """A Rollouter of the run's `fields` (all but SKIPPED) with its own scheduler, `runner` (an EnvRunner, wrapped
    in HostShardedEnvs) and the scripted sampler (no rollout engine: the copy samples nothing on a device)."""
    from posttrain.rollout import env_side, rollouter as rollouter_lib
    from posttrain.rollout.episodes import HostShardedEnvs

    st = fields["settings"]
    sources = env_side.task_sources(st.env_config.train)
    fn = scripted_sampler(fields["tokenizer"])

    class EnvBound(rollouter_lib.Rollouter):
        def sample_fn(self, policy, params):
            return fn

    return EnvBound(**fields, mesh=None, graphdef=None, engine=None, runner=HostShardedEnvs(runner),
                    scheduler=rollouter_lib.make_scheduler(st, {n: s for n, (_, _, s) in sources.items()}))


def proc_cpu_s(pids) -> float:
    """User + system CPU seconds of processes `pids` so far (/proc; 0 for one that is gone or without /proc)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return total


def produce(fields: dict, kind: str, latency_s: float, stop: threading.Event, on_batch,
            clock=time.thread_time) -> dict:
    """Runs `collect` (kind "sleep": SleepEnvs; else the run's EnvPool) until `stop`; `on_batch()` after each
    batch. Returns {batches, cpu_s_per_batch (of `clock`: this thread's CPU seconds by default),
    worker_cpu_s_per_batch} over the batches after the first."""
    import jax

    from posttrain.rollout import env_side

    st = fields["settings"]
    env = st.env_config
    runner = (SleepEnvs(latency_s, env.num_workers) if kind == "sleep" else
              env_side.make_runner(env.num_workers, env.step_timeout_s))
    r, marks, step = producer_rollouter(fields, runner), [], 0
    pids = lambda: [p for p in getattr(runner, "worker_pids", []) if p]  # noqa: E731
    try:
        while not stop.is_set():
            r.collect(step, None, jax.random.key(step))
            marks.append((clock(), proc_cpu_s(pids())))
            on_batch()
            step += 1
    finally:
        runner.close()
    n = max(len(marks) - 1, 1)
    return {"batches": len(marks),
            "cpu_s_per_batch": round((marks[-1][0] - marks[0][0]) / n, 5) if marks else None,
            "worker_cpu_s_per_batch": round((marks[-1][1] - marks[0][1]) / n, 5) if marks else None}


class Producer:
    """A running producer of `kind` (VARIANTS) for the run's rollouter: `wait_first()` blocks until its first batch
    is made; `stop()` ends it after the batch in progress and returns `produce`'s stats."""

    def __init__(self, rollouter, kind: str, latency_s: float):
        if kind not in VARIANTS:
            raise ValueError(f"kind must be one of {VARIANTS}, got {kind!r}")
        fields = {f.name: getattr(rollouter, f.name) for f in dataclasses.fields(rollouter) if f.name not in SKIPPED}
        self.kind, self._first, self._stats, self._error = kind, threading.Event(), {}, None
        if kind == "process":
            tokenizer = copy.copy(fields["tokenizer"])
            tokenizer._template = None  # its compiled chat template (a cache, rebuilt on use) does not pickle
            with tempfile.NamedTemporaryFile("wb", suffix=".pkl", delete=False) as f:
                pickle.dump(({**fields, "tokenizer": tokenizer}, latency_s), f)
            self._path = f.name
            path = [p or os.getcwd() for p in sys.path]  # what this process imports, the child does too
            self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), f.name], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True,
                                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)))
            self._thread = threading.Thread(target=self._read, daemon=True)
        else:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(fields, latency_s), daemon=True,
                                            name=f"gil-stall-{kind}")
        self._thread.start()

    def _run(self, fields, latency_s):
        try:
            self._stats = produce(fields, self.kind, latency_s, self._stop, self._first.set)
        except BaseException as e:  # noqa: BLE001 - raised by wait_first / stop, on the caller's thread
            self._error = e
        finally:
            self._first.set()

    def _read(self):
        try:
            for line in self._proc.stdout:
                if line.startswith("batch"):
                    self._first.set()
                elif line.startswith("stats "):
                    self._stats = json.loads(line[6:])
        finally:
            self._first.set()

    def wait_first(self) -> None:
        self._first.wait()
        if self._error is not None:
            raise self._error
        if not self._thread.is_alive() and not self._stats:
            raise RuntimeError(f"the {self.kind} producer ended before its first batch (its stderr says why)")

    def stop(self) -> dict:
        if self.kind == "process":
            self._proc.stdin.close()  # the child stops after its batch in progress
            self._proc.wait()
            os.unlink(self._path)
        else:
            self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return dict(self._stats)


def measure(update, rollouter, *, rounds: int, steps: int, latency_s: float) -> dict:
    """`update()` (seconds of one learner update) `steps` times alone, then next to each VARIANTS producer (each
    started afresh and timed from its first batch), `rounds` rounds. Per variant: ratio (median / median alone),
    mean_ratio, update_s (median) and the producer's stats of the last round; gil_part = thread / process and
    core_part = process / alone (ratios of medians)."""
    times = {v: [] for v in ("alone",) + VARIANTS}
    stats = {}
    for _ in range(rounds):
        times["alone"] += [update() for _ in range(steps)]
        for kind in VARIANTS:
            p = Producer(rollouter, kind, latency_s)
            try:
                p.wait_first()
                times[kind] += [update() for _ in range(steps)]
            finally:
                stats[kind] = p.stop()
    med = {v: statistics.median(t) for v, t in times.items()}
    mean = {v: statistics.fmean(t) for v, t in times.items()}
    out = {"learner_alone_s": round(med["alone"], 4), "alone_s": [round(x, 4) for x in times["alone"]]}
    for v in VARIANTS:
        out[v] = {"ratio": round(med[v] / med["alone"], 3), "mean_ratio": round(mean[v] / mean["alone"], 3),
                  "update_s": round(med[v], 4), "updates_s": [round(x, 4) for x in times[v]], **stats[v]}
    out["ratio"] = out["thread"]["ratio"]  # the check: the async loop's producer model
    out["gil_part"] = round(med["thread"] / med["process"], 3)
    out["core_part"] = out["process"]["ratio"]
    out["load_avg"] = os.getloadavg()[0]
    return out


def _child(path: str) -> None:
    """The `process` variant's producer: `produce` on the pickled fields until stdin closes; a line "batch" per
    batch and "stats {...}" at the end, on stdout."""
    with open(path, "rb") as f:
        fields, latency_s = pickle.load(f)
    stop = threading.Event()

    def watch():
        sys.stdin.read()  # returns when the parent closes our stdin
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    stats = produce(fields, "process", latency_s, stop, lambda: print("batch", flush=True),
                    clock=time.process_time)  # the whole child: its JAX client's threads too
    print("stats", json.dumps(stats), flush=True)


if __name__ == "__main__":
    sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]
    _child(sys.argv[1])
