"""Symbolic answer comparison in persistent worker processes, bounded in time from any thread.

math-verify's own timeout (SIGALRM) works only on the main thread, so warm workers answer one request at a time;
a caller that waits past its `timeout_s` kills its worker and a replacement starts in the background.
`symbolic_equal` runs in-process in tests. Why workers, and the equality rule: docs/verify.md.
"""
from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import threading
import time

DEFAULT_TIMEOUT_S = 5.0  # bound on one symbolic comparison (seconds)
START_TIMEOUT_S = 60.0  # bound on waiting for a worker to start (import of math-verify, seconds)
POOL_SIZE = 2  # worker processes per host process
WORKER_MEMORY_BYTES = 4 << 30  # RLIMIT_AS of a worker: a huge expression fails with MemoryError
REL_TOL = 1e-6  # relative tolerance, for decimal approximations of non-terminating values only
NUMERIC_DIGITS = 60  # digits for high-precision evaluation (exact comparison, math-verify's evalf)


# ---------------------------------------------------------------------------------- comparison
def _terminating(x) -> bool:
    """Whether exact number x (a sympy Rational) has a finite decimal expansion (denominator 2^a 5^b)."""
    q = int(x.q)
    for p in (2, 5):
        while q % p == 0:
            q //= p
    return q == 1


def numbers_equal(a, b) -> bool:
    """Equality of two sympy numbers (no free symbols): exact unless a side holds a Float.

    A Float against an exact terminating decimal must match to 1e-12 relative ("1234567.5" != 1234567); against a
    non-terminating value (1/3, sqrt(2), pi) or another Float, to REL_TOL relative. Two exact sides: a - b
    simplifies to 0 or is below 10^-(NUMERIC_DIGITS - 10) relative."""
    import sympy

    a, b = sympy.sympify(a).doit(), sympy.sympify(b).doit()
    has_float = [bool(x.atoms(sympy.Float)) for x in (a, b)]
    va, vb = (sympy.N(x, NUMERIC_DIGITS) for x in (a, b))
    if not (va.is_finite and vb.is_finite):  # zoo, oo, nan: only the same value is equal
        return a == b
    if not all(v.is_real for v in (va, vb)):  # complex values: compare parts
        return all(numbers_equal(f(a), f(b)) for f in (sympy.re, sympy.im))
    scale = max(abs(va), abs(vb))
    if scale == 0:
        return True
    diff = abs(va - vb) / scale
    if any(has_float):
        exact = b if has_float[0] else a
        if not all(has_float) and exact.is_Rational and _terminating(exact):
            return bool(diff <= 1e-12)
        return bool(diff <= REL_TOL)
    if sympy.simplify(a - b) == 0:
        return True
    return bool(diff <= sympy.Float(10) ** -(NUMERIC_DIGITS - 10))


def _is_number(x) -> bool:
    import sympy

    return isinstance(x, sympy.Expr) and not x.free_symbols and bool(x.is_number)


def _elements(x):
    """Elements of a tuple or finite set of numbers (None when x is not one)."""
    import sympy

    if isinstance(x, (sympy.Tuple, sympy.FiniteSet)) and all(_is_number(e) for e in x.args):
        return list(x.args)
    return None


def _structures_equal(g, p) -> bool | None:
    """Numbers, tuples and finite sets of numbers compared by `numbers_equal`; None: not such a pair."""
    import sympy

    if _is_number(g) and _is_number(p):
        return numbers_equal(g, p)
    eg, ep = _elements(g), _elements(p)
    if eg is None or ep is None or len(eg) != len(ep) or type(g) is not type(p):
        return None
    if isinstance(g, sympy.Tuple):
        return all(numbers_equal(x, y) for x, y in zip(eg, ep))
    unmatched = list(ep)  # finite sets: every element has its own partner
    for x in eg:
        hit = next((i for i, y in enumerate(unmatched) if numbers_equal(x, y)), None)
        if hit is None:
            return False
        unmatched.pop(hit)
    return True


def _extraction_config() -> list:
    """math-verify's default extraction without its unit stripping, which deletes single letters ("5m" == 5) that
    can be variables; units are stripped before, from `envs.verify.text.UNITS`."""
    from latex2sympy2_extended.math_normalization import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    norm = NormalizationConfig(basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all",
                               equations=False)
    return [LatexExtractionConfig(normalization_config=norm), ExprExtractionConfig()]


def symbolic_equal(pred: str, gold: str) -> bool:
    """Whether LaTeX answers `pred` and `gold` are equal (HuggingFace math-verify parsing, rule in docs/verify.md).

    Unbounded in time: call it through `WorkerPool.compare` outside tests. A parse failure is "not equal"."""
    import math_verify

    gold_parsed = math_verify.parse(f"${gold}$", _extraction_config(), parsing_timeout=None)
    pred_parsed = math_verify.parse(f"${pred}$", _extraction_config(), parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    try:
        same = _structures_equal(gold_parsed[0], pred_parsed[0])
    except (TypeError, ValueError, AttributeError):
        same = None
    if same is not None:
        return same
    return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None, numeric_precision=NUMERIC_DIGITS))


# ---------------------------------------------------------------------------------- worker side
def _worker_main() -> None:
    """Answer {"p": pred, "g": gold} lines from stdin with {"eq", "err"} lines; exit when stdin or the parent goes."""
    import logging

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeout is off
    parent = os.getppid()

    def watchdog() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    import math_verify  # noqa: F401  (the import is what makes a warm worker fast)

    out = os.fdopen(os.dup(1), "w")  # replies only; anything a library prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            reply = {"eq": symbolic_equal(req["p"], req["g"]), "err": ""}
        except Exception as exc:  # noqa: BLE001 - any failure is "not equal", with the reason
            reply = {"eq": False, "err": f"{type(exc).__name__}: {str(exc)[:200]}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# ---------------------------------------------------------------------------------- pool side
class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", "-u", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        self.buf = b""

    def read_line(self, deadline: float) -> bytes | None:
        """One reply line; None when the deadline passes, b"" when the worker closed its output (died)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def kill(self) -> None:
        """Kill and reap the process and close its pipes. Never raises: a request the dead worker never read
        is still in stdin's buffer, and closing flushes it (BrokenPipeError), which is dropped here."""
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class WorkerPool:
    """Up to `size` warm worker processes shared by all threads of this process (thread-safe)."""

    def __init__(self, size: int = POOL_SIZE) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"WorkerPool: size must be an int >= 1, got {size!r}")
        self.size, self._idle, self._live = size, [], 0
        self._cond = threading.Condition()
        self.started = self.killed = 0  # counters, for tests and metrics

    def _start(self) -> _Worker | None:
        """A new worker that has finished its imports, or None if it failed to start in time."""
        worker = _Worker()
        if worker.read_line(time.monotonic() + START_TIMEOUT_S) != b"ready":
            worker.kill()
            return None
        with self._cond:
            self.started += 1
        return worker

    def _replace(self) -> None:  # background: keep the pool warm after a kill
        worker = self._start()
        with self._cond:
            if worker is None:
                self._live -= 1
            else:
                self._idle.append(worker)
            self._cond.notify()

    def _acquire(self, deadline: float) -> _Worker | None:
        with self._cond:
            while not self._idle:
                if self._live < self.size:
                    self._live += 1
                    break
                if not self._cond.wait(deadline - time.monotonic()) and not self._idle:
                    return None
            else:
                return self._idle.pop()
        worker = self._start()
        if worker is None:
            with self._cond:
                self._live -= 1
                self._cond.notify()
        return worker

    def compare(self, pred: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[bool | None, str]:
        """(equal, reason) from a worker, within START_TIMEOUT_S + `timeout_s` seconds.

        equal is None after `timeout_s` (the worker is killed; reason "timeout: ...") or when no worker was free or
        started, or it died or answered garbage ("infra: ..."). Raises ValueError on a non-positive timeout."""
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"verifier timeout_s must be a positive number, got {timeout_s!r}")
        worker = self._acquire(time.monotonic() + START_TIMEOUT_S)
        if worker is None:
            return None, f"infra: no verifier worker started within {START_TIMEOUT_S:g} s"
        try:
            worker.proc.stdin.write((json.dumps({"p": pred, "g": gold}) + "\n").encode())
            worker.proc.stdin.flush()
            line = worker.read_line(time.monotonic() + timeout_s)
        except OSError:
            line = b""
        try:
            reply = json.loads(line) if line else None
        except ValueError:
            reply = None
        if reply is None:
            worker.kill()
            with self._cond:
                self.killed += 1
            threading.Thread(target=self._replace, daemon=True).start()
            if line is not None:
                return None, f"infra: verifier worker failed (exit {worker.proc.returncode}, reply {line[:80]!r})"
            return None, f"timeout: symbolic comparison took over {timeout_s:g} s (worker killed)"
        with self._cond:
            self._idle.append(worker)
            self._cond.notify()
        return bool(reply["eq"]), reply["err"]

    def close(self) -> None:
        """Stop the idle workers (busy ones are stopped by their caller's timeout)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._live -= len(idle)
        for worker in idle:
            worker.kill()


_pool: tuple[int, WorkerPool] | None = None
_pool_lock = threading.Lock()


def pool() -> WorkerPool:
    """This process's WorkerPool (a forked child gets its own; workers are stopped at exit)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            import atexit

            _pool = (os.getpid(), WorkerPool())
            atexit.register(_pool[1].close)
        return _pool[1]


if __name__ == "__main__":
    _worker_main()
