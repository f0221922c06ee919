"""Ahead-of-time compilation for accelerators we do not have: devices of a target topology, per-device memory
read off the compiled program, and the largest buffers of XLA's buffer assignment.

Targets (published figures: NVIDIA H200 SXM datasheet; Google Cloud TPU v5p system architecture page):
  h200  GPU, 141 GB HBM3e (about 139 GiB usable), 989 TFLOP/s dense bf16, 4.8 TB/s. Needs the `aot` extra
        (jax-cuda12-plugin + pjrt of the installed jaxlib's version; no CUDA libraries) and runs on a CPU machine.
  v5p   TPU, 95 GiB HBM2e, 459 TFLOP/s bf16, 2.765 TB/s. Needs the `tpu` extra (libtpu).

Memory per device = argument + output + temp - alias bytes of `compiled.memory_analysis()` (donated inputs alias
outputs). Facts: `../shared/PLATFORM-NOTES.md`; the H200 target description ships as `targets/h200.txtpb`.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import tempfile
import time

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str  # "gpu" | "tpu"
    hbm_bytes: int  # usable HBM per device
    peak_bf16_flops: float  # dense bf16 matmul peak per device (published)
    hbm_bandwidth: float  # bytes/s per device (published)
    default_topology: str


TARGETS = {
    "h200": Target("h200", "gpu", int(139 * GIB), 989e12, 4.8e12, "1x1x1"),
    "v5p": Target("v5p", "tpu", int(95 * GIB), 459e12, 2.765e12, "v5p:2x2x1"),
}
_INSTALL = {"gpu": "pip install -e '.[aot]' (jax-cuda12-plugin/pjrt matching jaxlib) and run with JAX_PLATFORMS=cpu",
            "tpu": "pip install -e '.[tpu]' (libtpu)"}


def target_devices(name: str, topology: str | None = None) -> list:
    """The devices of `topology` (default: the target's) on target `name`, for building a Mesh to compile against.

    Raises ValueError for an unknown target, RuntimeError (with the install command) when the compiler plugin for
    the target is missing.
    """
    if name not in TARGETS:
        raise ValueError(f"unknown AOT target {name!r}; known: {sorted(TARGETS)}")
    t = TARGETS[name]
    from jax.experimental import topologies

    try:
        if t.platform == "gpu":
            config = (pathlib.Path(__file__).parent / "targets" / f"{name}.txtpb").read_text()
            desc = topologies.get_topology_desc("gpu", "cuda", target_config=config,
                                                topology=topology or t.default_topology)
        else:
            desc = topologies.get_topology_desc(platform="tpu", topology_name=topology or t.default_topology)
    except Exception as e:  # noqa: BLE001 - the plugins raise assorted errors when absent
        raise RuntimeError(f"cannot compile for {name} on this machine ({type(e).__name__}: {str(e)[:200]}); "
                           f"install the compiler with: {_INSTALL[t.platform]}") from e
    return list(desc.devices)


@dataclasses.dataclass
class MemoryReport:
    """Per-device bytes of one compiled program and its largest buffers [(bytes, shape, producing op)]."""

    argument: int
    output: int
    temp: int
    alias: int
    largest: list

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias

    def as_dict(self) -> dict:
        g = lambda b: round(b / GIB, 3)
        return {"peak_gib": g(self.peak), "argument_gib": g(self.argument), "output_gib": g(self.output),
                "temp_gib": g(self.temp), "alias_gib": g(self.alias),
                "largest_buffers": [{"gib": g(b), "shape": s, "op": op} for b, s, op in self.largest]}


def compile_with_report(lowered, top: int = 5):
    """Compiles a `jax.stages.Lowered` with XLA's buffer-assignment dump; returns (compiled, MemoryReport, seconds).

    The largest buffers are the `top` largest distinct values in the buffer assignment (shapes as XLA prints them).
    Run it without JAX's persistent compilation cache: a cached executable is loaded, not compiled, and leaves no
    buffer report (and a meaningless compile time).
    """
    with tempfile.TemporaryDirectory() as dump:
        t = time.perf_counter()
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_pass_re": "NOTHING"})
        seconds = time.perf_counter() - t
        largest = largest_buffers(pathlib.Path(dump), top)
    m = compiled.memory_analysis()
    report = MemoryReport(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
                          m.alias_size_in_bytes, largest)
    return compiled, report, seconds


_VALUE_RE = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)")


def largest_buffers(dump_dir: pathlib.Path, top: int = 5) -> list:
    """[(bytes, shape, op)] of the largest values in the newest `*buffer-assignment.txt` of an XLA dump."""
    files = sorted(dump_dir.glob("*buffer-assignment.txt"), key=lambda p: p.stat().st_mtime)
    if not files:
        return []
    seen = {}
    for line in files[-1].read_text(errors="replace").splitlines():
        m = _VALUE_RE.match(line)
        if m:
            op, size, shape = m.group(1), int(m.group(2)), m.group(3).split("{")[0]
            seen[op] = max(seen.get(op, (0, ""))[0], size), shape
    ranked = sorted(((size, shape, op) for op, (size, shape) in seen.items()), reverse=True)
    return ranked[:top]
