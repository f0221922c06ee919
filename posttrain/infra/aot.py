"""Ahead-of-time compilation for accelerators we do not have: target devices, per-device memory, collectives.

Targets, the extras to install and the memory accounting: docs/aot.md."""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import tempfile
import time

GIB = 1 << 30
HBM_FIT_FRACTION = 0.9  # the rest of a device's memory: the runtime's own allocations and fragmentation


def fits(peak_bytes: int, hbm_bytes: int) -> bool:
    """Whether a program's peak (bytes per device) is at most HBM_FIT_FRACTION of a device's `hbm_bytes`."""
    return peak_bytes <= HBM_FIT_FRACTION * hbm_bytes


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
    "v5e": Target("v5e", "tpu", int(16 * GIB), 197e12, 0.819e12, "v5e:1x1"),
    "v6e": Target("v6e", "tpu", int(32 * GIB), 918e12, 1.638e12, "v6e:1x1"),
}
_INSTALL = {"gpu": "VENV=.venv-aot scripts/setup_env.sh aot (a venv of its own: with the CUDA plugin installed every "
                   "JAX start probes for a GPU), then run that venv's posttrain with JAX_PLATFORMS=cpu",
            "tpu": "scripts/setup_env.sh tpu (libtpu)"}


def target_devices(name: str, topology: str | None = None) -> list:
    """The devices of `topology` (default: the target's) on target `name`, for a Mesh to compile against.

    Raises ValueError for an unknown target, RuntimeError (with the install command) without its compiler plugin."""
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
            topology = topology or t.default_topology
            # a slice smaller than libtpu's default host (2x2x1 chips) must say that its one host holds all of it
            single = {"chips_per_host_bounds": [1, 1, 1]} if topology.endswith(":1x1") else {}
            desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **single)
    except Exception as e:  # noqa: BLE001 - the plugins raise assorted errors when absent
        raise RuntimeError(f"cannot compile for {name} on this machine ({type(e).__name__}: {str(e)[:200]}); "
                           f"install the compiler with: {_INSTALL[t.platform]}") from e
    return list(desc.devices)


@dataclasses.dataclass
class MemoryReport:
    """Per-device bytes of one compiled program and its largest buffers [(bytes, shape, op)] (docs/aot.md)."""

    argument: int
    output: int
    temp: int
    alias: int
    largest: list
    assigned_temp: int | None = None

    @property
    def peak(self) -> int:
        temp = self.temp if self.assigned_temp is None else self.assigned_temp
        return self.argument + self.output + temp - self.alias

    def as_dict(self) -> dict:
        g = lambda b: round(b / GIB, 6)
        return {"peak_gib": g(self.peak), "argument_gib": g(self.argument), "output_gib": g(self.output),
                "temp_gib": g(self.temp), "assigned_temp_gib": None if self.assigned_temp is None else
                g(self.assigned_temp), "alias_gib": g(self.alias),
                "largest_buffers": [{"gib": g(b), "shape": s, "op": op} for b, s, op in self.largest]}


@contextlib.contextmanager
def no_persistent_cache():
    """JAX's persistent compilation cache off for the compiles inside (`reset_cache` makes JAX decide again)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def compile_with_report(lowered, top: int = 5):
    """Compiles `lowered` with a buffer-assignment dump, bypassing the cache: (compiled, MemoryReport, seconds)."""
    with tempfile.TemporaryDirectory() as dump, no_persistent_cache():
        t = time.perf_counter()
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_pass_re": "NOTHING"})
        seconds = time.perf_counter() - t
        largest = largest_buffers(pathlib.Path(dump), top)
        assigned = assigned_temp_bytes(pathlib.Path(dump))
    m = compiled.memory_analysis()
    report = MemoryReport(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
                          m.alias_size_in_bytes, largest, assigned)
    return compiled, report, seconds


_VALUE_RE = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)")


_TEMP_RE = re.compile(r"^allocation \d+: size (\d+),(?! color [1-9])[^\n]*preallocated-temp", re.M)


def _buffer_assignment(dump_dir: pathlib.Path) -> str | None:
    """The text of the newest `*buffer-assignment.txt` of an XLA dump, or None."""
    files = sorted(dump_dir.glob("*buffer-assignment.txt"), key=lambda p: p.stat().st_mtime)
    return files[-1].read_text(errors="replace") if files else None


def assigned_temp_bytes(dump_dir: pathlib.Path) -> int | None:
    """Bytes of the device-memory temp allocations in an XLA dump's buffer assignment, or None without one."""
    text = _buffer_assignment(dump_dir)
    return None if text is None else sum(int(b) for b in _TEMP_RE.findall(text))


def largest_buffers(dump_dir: pathlib.Path, top: int = 5) -> list:
    """[(bytes, shape, op)] of the largest values in an XLA dump's buffer assignment."""
    text = _buffer_assignment(dump_dir)
    if text is None:
        return []
    seen = {}
    for line in text.splitlines():
        m = _VALUE_RE.match(line)
        if m:
            op, size, shape = m.group(1), int(m.group(2)), m.group(3).split("{")[0]
            seen[op] = max(seen.get(op, (0, ""))[0], size), shape
    ranked = sorted(((size, shape, op) for op, (size, shape) in seen.items()), reverse=True)
    return ranked[:top]


# ----------------------------------------------------------------------------------------------- collective bytes
COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                    "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16}
_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_COLLECTIVE_RE = re.compile(r"^(.*?)\s(" + "|".join(sorted(COLLECTIVE_KINDS, key=len, reverse=True)) +
                            r")(-start)?\(([^)]*)\)")
_CALLEE_RE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _type_bytes(type_text: str) -> int:
    """Bytes of an HLO type as printed (array or tuple; layouts ignored)."""
    total = 0.0
    for dtype, dims in _SHAPE_RE.findall(type_text):
        if dtype in _DTYPE_BYTES:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * _DTYPE_BYTES[dtype]
    return int(total)


def collective_bytes(hlo_text: str) -> dict:
    """{kind: bytes} each device moves per execution, plus "total", from optimized HLO text (`compiled.as_text()`).

    Counting rules: docs/aot.md; "unknown_trip_count_loops": loops without a known trip count (counted once)."""
    comps, types, current = {}, {}, None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            current = comps.setdefault(name.lstrip("%"), {"entry": line.startswith("ENTRY"), "ops": [],
                                                          "calls": []})
            continue
        m = _INSTR_RE.match(line)
        if not m or current is None:
            continue
        name, rest = m.groups()
        c = _COLLECTIVE_RE.match(rest)
        if c:
            types[name] = c.group(1)
            operands = [o.split()[-1].lstrip("%") for o in c.group(4).split(",") if o.strip()]
            current["ops"].append((c.group(2), c.group(1), bool(c.group(3)), operands))
        else:  # the result type: a tuple in parentheses or one array type
            types[name] = rest[:_closing_paren(rest) + 1] if rest.startswith("(") else rest.split(" ", 1)[0]
        trips = int(t.group(1)) if (t := _TRIP_RE.search(rest)) else None
        for role, callee in _CALLEE_RE.findall(rest):
            current["calls"].append((callee, trips if role in ("body", "condition") else 1, role))
        for b in _BRANCHES_RE.findall(rest):
            current["calls"] += [(x.strip().lstrip("%"), 1, "branch") for x in b.split(",") if x.strip()]
    out = dict.fromkeys(COLLECTIVE_KINDS, 0)
    unknown = set()

    def visit(name, mult, depth=0):
        comp = comps.get(name)
        if comp is None or depth > 64:
            return
        for kind, result_type, is_async, operands in comp["ops"]:
            if kind == "ragged-all-to-all":  # operands: input, output buffer, offsets and sizes: the input moves
                operands = operands[:1]
            operand = sum(_type_bytes(types.get(o, "")) for o in operands)
            result = _type_bytes(result_type) - (operand if is_async and result_type.startswith("(") else 0)
            moved = result if kind == "all-gather" else operand  # an async start's result tuple holds its operands
            out[kind] += mult * moved
        for callee, trips, role in comp["calls"]:
            if role == "body" and trips is None:
                unknown.add(callee)
            if role != "condition":
                visit(callee, mult * (trips or 1), depth + 1)

    for name, comp in comps.items():
        if comp["entry"]:
            visit(name, 1)
    out["total"] = sum(out[k] for k in COLLECTIVE_KINDS)
    out["unknown_trip_count_loops"] = len(unknown)
    return out


def _closing_paren(text: str) -> int:
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return i
    return len(text) - 1
