"""Where a call's device time goes: one call under `jax.profiler.trace`, its XLA ops summed from the trace.

    summary = profile_call(fn)        # fn() runs once, traced; returns a JSON-able dict (below)

Used by `bench/rollout.py --profile` (the sampler, and the paged engine with --lengths long_tail) so that a run
on a rarely lent accelerator says why a decode step costs what it costs, not only how long it takes. No extra
package: the trace (`*.xplane.pb`) is read with `jax.profiler.ProfileData`.

Which events count (the XSpace planes of the trace):
  * a GPU or TPU run: the device planes ("/device:..."), on each its "XLA Ops" line when it has one (one event
    per executed HLO op), else its "Stream ..." lines (the kernels), else every line;
  * a CPU run (no device plane): the host plane's events that carry an `hlo_op` stat (the thunk executor's).
Each event is keyed by its `hlo_op` stat (else its name) and its `hlo_module` stat (the jitted program, e.g.
`jit_sample`) and counts its own time: its duration minus that of the events nested in it on its line (a `while`
op holds its body's ops). Ops running at once on several threads or streams add up: `busy_s`, the union of the
counted intervals, is the time some op ran.

The summary: wall_s (the traced call), busy_s and busy_frac (busy_s / wall_s: what is left is host work, launch
gaps and waiting), events, op_s (summed own time), top_ops (the `top` largest by own time: {op, module, s,
count} and, where the trace has them (a CPU trace does not; a GPU trace has not been read yet), the op's
hlo_category, tf_op (JAX's name stack: the source of the op) and long_name), modules ({module: seconds}),
categories ({hlo_category: seconds}) and the planes read. Raises FileNotFoundError when the trace wrote no
xplane file.
"""
from __future__ import annotations

import collections
import glob
import os
import tempfile
import time


SOURCE_STATS = ("hlo_category", "tf_op", "long_name")  # copied into a top op's entry when the trace has them


def _stats(event) -> dict:
    try:
        return dict(event.stats)
    except Exception:  # noqa: BLE001  (a stat whose value type the binding cannot convert)
        return {}


def _counted_events(profile):
    """(plane name, [(start_ns, duration_ns, event, stats)] of one line) for each line whose events count (module
    doc)."""
    planes = list(profile.planes)
    device = [p for p in planes if p.name.startswith("/device:")]
    for plane in device or [p for p in planes if p.name.startswith("/host:CPU")]:
        lines = list(plane.lines)
        chosen = lines
        if device:  # one timeline of ops: xprof's derived "XLA Ops" line, else the raw kernels on the streams
            chosen = ([line for line in lines if line.name == "XLA Ops"]
                      or [line for line in lines if line.name.startswith("Stream")] or lines)
        for line in chosen:
            events = []
            for event in line.events:
                stats = _stats(event)
                if not device and "hlo_op" not in stats:
                    continue
                events.append((int(event.start_ns), int(event.duration_ns), event, stats))
            yield plane.name, events


def _self_ns(events) -> list[int]:
    """Each event's own time on its line: its duration minus that of the events nested in it (a `while` op holds
    its body's ops), so that nothing is counted twice."""
    order = sorted(range(len(events)), key=lambda i: (events[i][0], -events[i][1]))
    own, stack = [e[1] for e in events], []
    for i in order:
        start, ns = events[i][0], events[i][1]
        while stack and events[stack[-1]][0] + events[stack[-1]][1] <= start:
            stack.pop()
        if stack:
            own[stack[-1]] -= ns
        stack.append(i)
    return own


def _union_ns(intervals) -> int:
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def summarize(path: str, wall_s: float, top: int = 15) -> dict:
    """The summary (module doc) of the xplane file at `path`, for a call that took `wall_s` seconds."""
    from jax.profiler import ProfileData

    profile = ProfileData.from_file(path)
    by_op, by_module, by_category, intervals, planes = (collections.Counter(), collections.Counter(),
                                                        collections.Counter(), [], set())
    counts, about = collections.Counter(), {}
    for plane, events in _counted_events(profile):
        for (start, ns, event, stats), own in zip(events, _self_ns(events)):
            key = str(stats.get("hlo_op", event.name)), str(stats.get("hlo_module", ""))
            by_op[key] += own
            counts[key] += 1
            by_module[key[1]] += own
            if "hlo_category" in stats:
                by_category[str(stats["hlo_category"])] += own
            if key not in about:
                about[key] = {k: str(stats[k])[:200] for k in SOURCE_STATS if k in stats}
            intervals.append((start, start + ns))
            planes.add(plane)
    busy = _union_ns(intervals) / 1e9
    seconds = lambda counter: {k: round(ns / 1e9, 4) for k, ns in counter.most_common()}
    return {"wall_s": round(wall_s, 4), "busy_s": round(busy, 4),
            "busy_frac": round(busy / wall_s, 3) if wall_s > 0 else None, "events": sum(counts.values()),
            "op_s": round(sum(by_op.values()) / 1e9, 4),
            "top_ops": [{"op": op, "module": module, "s": round(ns / 1e9, 4), "count": counts[op, module],
                         **about[op, module]} for (op, module), ns in by_op.most_common(top)],
            "modules": seconds(by_module), "categories": seconds(by_category), "planes": sorted(planes)}


def profile_call(fn, top: int = 15) -> dict:
    """Runs `fn()` once under `jax.profiler.trace` (blocking on its result) and returns `summarize` of the trace.
    Call it after a warm-up call, so that the trace holds no compile."""
    import jax

    with tempfile.TemporaryDirectory(prefix="bench_profile_") as tmp:
        with jax.profiler.trace(tmp):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            wall = time.perf_counter() - t
        files = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise FileNotFoundError(f"jax.profiler.trace wrote no *.xplane.pb under {tmp}")
        return summarize(max(files, key=os.path.getmtime), wall, top)
