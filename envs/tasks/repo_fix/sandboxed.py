"""The programs RepoFix-v0 runs inside the sandbox (standard library only; importing this module runs nothing).

The host runs it as ``python -I -S -c <source> <mode>`` with a JSON payload on stdin (`scoring.run_program`).
Modes: ``score`` (the trusted runner; the package runs only in a ``worker`` process), ``worker`` and ``validate``
(trusted code only, timed in executed lines). How each keeps the package from the tests: docs/repo_fix.md.
"""
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time

MAX_DEPTH = 64  # nesting of encoded values
MAX_ITEMS = 1_000_000  # elements of one encoded value
MAX_REPLY_BYTES = 16 << 20  # one worker reply
WORKER_MEMORY_BYTES = 768 << 20  # RLIMIT_AS of a worker / validation child
VALIDATED = "VALIDATED "
SLOWDOWN = 4  # a mutant's case "times out" after this many times the lines the canonical solution ran in all
MIN_LINE_BUDGET = 20_000  # lines (a deterministic clock: the same verdict on any machine, under any load)
MAX_LINE_BUDGET = 1_000_000  # per case, for the canonical solution too (the few heavier problems yield no task)
_SEQUENCES = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_DECODE_SEQUENCES = {"l": list, "t": tuple, "S": set, "F": frozenset}


def encode(value, _depth=0, _count=None):
    """A JSON-able form of `value`, built of exact builtin types only (a rigged ``__eq__`` or int subclass is refused).

    Raises TypeError for any other type, ValueError when too deep (MAX_DEPTH) or too large (MAX_ITEMS)."""
    count = _count if _count is not None else [0]
    count[0] += 1
    if _depth > MAX_DEPTH or count[0] > MAX_ITEMS:
        raise ValueError("value too deep or too large to compare")
    kind = type(value)
    if value is None:
        return ["n"]
    if kind is bool:
        return ["b", value]
    if kind is int:
        return ["i", str(value)]
    if kind is float:
        return ["f", repr(value)]
    if kind is complex:
        return ["c", repr(value.real), repr(value.imag)]
    if kind is str:
        return ["s", value]
    if kind is bytes:
        return ["y", value.hex()]
    if kind in _SEQUENCES:
        return [_SEQUENCES[kind], [encode(v, _depth + 1, count) for v in value]]
    if kind is dict:
        return ["d", [[encode(k, _depth + 1, count), encode(v, _depth + 1, count)] for k, v in value.items()]]
    raise TypeError(f"unsupported type {kind.__name__} (only builtin values can be compared)")


def decode(data):
    """The value `encode` made `data` from. Raises ValueError / TypeError / KeyError on malformed data."""
    tag = data[0]
    simple = {"n": lambda: None, "b": lambda: bool(data[1]), "i": lambda: int(data[1]), "f": lambda: float(data[1]),
              "c": lambda: complex(float(data[1]), float(data[2])), "s": lambda: str(data[1]),
              "y": lambda: bytes.fromhex(data[1])}
    if tag in simple:
        return simple[tag]()
    if tag in _DECODE_SEQUENCES:
        return _DECODE_SEQUENCES[tag](decode(v) for v in data[1])
    if tag == "d":
        return {decode(k): decode(v) for k, v in data[1]}
    raise ValueError(f"bad encoded value tag {tag!r}")


def _limit_child():
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    cap = WORKER_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(hard, WORKER_MEMORY_BYTES)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


# ----------------------------------------------------------------------------------------------- worker
def worker_main():
    """Serve ``{"module", "entry", "args", "kwargs"}`` requests from stdin, one reply line each on stdout."""
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the package's own prints and reads never touch the protocol
        os.dup2(devnull, fd)
    sys.path.append(os.getcwd())
    import importlib

    for line in requests:
        try:
            request = json.loads(line)
            function = getattr(importlib.import_module(request["module"]), request["entry"])
            reply = {"ok": encode(function(*decode(request["args"]), **decode(request["kwargs"])))}
        except BaseException as exc:  # noqa: BLE001 - SystemExit from the package is a failed call too
            try:
                reply = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            except BaseException:  # noqa: BLE001 - an exception whose str() raises
                reply = {"error": "exception"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class CandidateError(Exception):
    """The function under test raised, timed out, died, or returned something that is not a builtin value."""


class Worker:
    """A ``worker`` process; `call` sends one call and waits for its reply until `deadline` (time.monotonic)."""

    def __init__(self, program: str, deadline: float) -> None:
        self.deadline = deadline
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", program, "worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
                                     preexec_fn=_limit_child)
        self.buffer = b""

    def call(self, module: str, entry: str, args: tuple, kwargs: dict):
        request = {"module": module, "entry": entry, "args": encode(list(args)), "kwargs": encode(dict(kwargs))}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            raise CandidateError(f"worker gone: {exc}") from None
        reply = json.loads(self._read_line())
        if "error" in reply:
            raise CandidateError(str(reply["error"]))
        return decode(reply["ok"])

    def _read_line(self) -> bytes:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise CandidateError("timed out")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise CandidateError("worker exited")
            self.buffer += chunk
            if len(self.buffer) > MAX_REPLY_BYTES:
                raise CandidateError("reply too large")
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


# ----------------------------------------------------------------------------------------------- score
NOT_DUMPABLE_FAILED = "repo_fix runner: could not make itself non-dumpable"


def _not_dumpable() -> bool:
    """prctl(PR_SET_DUMPABLE, 0): same-uid processes (the worker) can no longer ptrace this one or open its
    /proc/<pid>/fd, mem or environ (which would show them the payload: the nonce and the hidden tests)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 - no ctypes, no libc
        return False


class Workers:
    """The worker of a suite: started on first use, replaced after any failed call (never reused after a crash)."""

    def __init__(self, program: str) -> None:
        self.program, self.worker = program, None

    def call(self, deadline: float, module: str, entry: str, args: tuple, kwargs: dict):
        if self.worker is None:
            self.worker = Worker(self.program, deadline)
        self.worker.deadline = deadline
        try:
            return self.worker.call(module, entry, args, kwargs)
        except CandidateError:
            self.close()
            raise

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def score_case(workers: Workers, suite: dict, case: str, case_s: float) -> bool:
    """Whether `case` passes with ``candidate`` proxied to the suite's worker (`suite`: module, entry, prelude)."""
    namespace = {"__name__": "__repo_fix_test__"}
    deadline = time.monotonic() + case_s
    try:
        exec(compile(suite["prelude"], "<prelude>", "exec"), namespace)
        namespace["candidate"] = lambda *a, **k: workers.call(deadline, suite["module"], suite["entry"], a, k)
        exec(compile(case, "<case>", "exec"), namespace)
        return True
    except Exception:  # noqa: BLE001 - an assertion, a candidate error, anything: the case fails
        return False


def score_suite(program: str, suite: dict, case_s: float) -> list[bool]:
    workers = Workers(program)
    try:
        return [score_case(workers, suite, case, case_s) for case in suite["cases"]]
    finally:
        workers.close()


def score_main() -> None:
    payload = json.loads(sys.stdin.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the payload's memfd is no longer reachable as this process's fd 0
    if not _not_dumpable():  # fail closed, before any of the package's code has run
        sys.stderr.write(NOT_DUMPABLE_FAILED + "\n")
        sys.exit(3)
    out = {side: [score_suite(payload["program"], suite, payload["case_s"]) for suite in payload[side]]
           for side in ("hidden", "visible")}  # hidden first: they decide the reward if time runs out
    sys.stdout.write("\n" + payload["nonce"] + " " + json.dumps(out) + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------- validate
class _CaseTimeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _CaseTimeout()


def _line_counter(budget):
    """(trace function, counter): counts executed lines; over `budget` (None: no budget) it raises _CaseTimeout."""
    count = [0]

    def trace(frame, event, arg):
        if event == "line":
            count[0] += 1
            if budget is not None and count[0] > budget:
                raise _CaseTimeout()
        return trace

    return trace, count


def _run_case(namespace: dict, case: str, case_s: float, trace) -> str:
    signal.setitimer(signal.ITIMER_REAL, case_s)
    sys.settrace(trace)
    try:
        exec(compile(case, "<case>", "exec"), namespace)
        return "pass"
    except _CaseTimeout:
        return "timeout"
    except BaseException:  # noqa: BLE001 - a mutant may raise anything, SystemExit included
        return "fail"
    finally:
        sys.settrace(None)
        signal.setitimer(signal.ITIMER_REAL, 0)


def _run_cases(payload: dict, text: str) -> dict:
    """In the forked child: exec `text`, run every case against its entry function (codec round trip); each case's
    executed lines are counted (over ``line_budget`` it is a timeout) and summed into "lines"."""
    module = {"__name__": payload["module"]}
    exec(compile(text, "<module>", "exec"), module)
    function = module[payload["entry"]]

    def candidate(*args, **kwargs):
        return decode(encode(function(*decode(encode(list(args))), **decode(encode(kwargs)))))

    signal.signal(signal.SIGALRM, _on_alarm)
    out, lines = {}, 0
    for side in ("visible", "hidden"):
        outcomes = []
        for case in payload[side]:
            namespace = {"__name__": "__repo_fix_test__"}
            exec(compile(payload["prelude"], "<prelude>", "exec"), namespace)
            namespace["candidate"] = candidate
            trace, count = _line_counter(payload.get("line_budget"))
            outcomes.append(_run_case(namespace, case, payload["case_s"], trace))
            lines += count[0]
            if outcomes[-1] == "timeout":  # one is enough to rule the text out; stop its run here
                return {**out, side: outcomes, "stopped": True, "lines": lines}
        out[side] = outcomes
    return {**out, "lines": lines}


def _validate_text(payload: dict, text: str) -> dict:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(read_fd)
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            _limit_child()
            os.write(write_fd, json.dumps(_run_cases(payload, text)).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    data, deadline = b"", time.monotonic() + payload["text_s"]
    while time.monotonic() < deadline and select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(read_fd, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.close(read_fd)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    try:
        return json.loads(data)
    except ValueError:
        return {"error": "the module crashed or ran out of time"}


def validate_main() -> None:
    payload = json.loads(sys.stdin.read())
    stop = time.monotonic() + payload["budget_s"]
    results = [_validate_text({**payload, "line_budget": MAX_LINE_BUDGET}, payload["texts"][0])]  # the solution
    budget = min(MAX_LINE_BUDGET, max(MIN_LINE_BUDGET, SLOWDOWN * results[0].get("lines", 0)))
    mutant = {**payload, "line_budget": budget}
    results += [_validate_text(mutant, text) if time.monotonic() < stop else {"error": "over the time budget"}
                for text in payload["texts"][1:]]
    sys.stdout.write(VALIDATED + json.dumps(results) + "\n")


MODES = {"score": score_main, "worker": worker_main, "validate": validate_main}

if __name__ == "__main__":
    MODES[sys.argv[1]]()
