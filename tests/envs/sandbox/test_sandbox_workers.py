"""Persistent sandbox workers (envs/sandbox/workers.py): the escape suite inside a worker, and a table of
tasks whose effects the next task in the same worker must not see. One pool per module (one worker, so
consecutive tasks share it); every test ends with no sandbox process or dir left but the worker's own."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from envs import sandbox
from envs.sandbox import Limits, fork_worker, procs
from envs.sandbox.workers import SandboxPool, shared_pool

ROOT = Path(__file__).resolve().parents[3]
FAST = Limits(cpu_s=5, wall_s=10)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(size=1, limits=FAST) as p:
        yield p
    assert p.workers == []


@pytest.fixture(autouse=True)
def no_leaks_after_each_test():
    yield
    assert sandbox.find_leaks() == []


def _server(pool: SandboxPool) -> psutil.Process:
    pool.start(1)
    (w,) = pool.workers
    return psutil.Process(w.server_pid)


def test_programs_run_with_stdin_files_and_exec(pool):
    r = pool.run("import sys; print(sys.stdin.read()[::-1], sys.argv, __name__)", stdin="olleh")
    assert (r.status, r.returncode, r.stdout) == ("ok", 0, "hello ['main.py'] __main__\n")
    r = pool.run({"lib/util.py": "X = 41\n", "app.py": b"from lib.util import X\nprint(X + 1)\n"}, [sandbox.PYTHON, "app.py"])
    assert (r.status, r.stdout) == ("ok", "42\n")
    r = pool.run({"a.sh": "echo hi; exit 3"}, ["bash", "a.sh"])
    assert (r.status, r.returncode, r.stdout, r.reason) == ("runtime_error", 3, "hi\n", "exit code 3")
    r = pool.run("import sys\nsys.exit('bad')")
    assert (r.status, r.returncode, r.stderr) == ("runtime_error", 1, "bad\n")
    r = pool.run("def f():\n    raise KeyError(7)\nf()")
    assert r.status == "runtime_error" and r.stderr.startswith("Traceback") and "KeyError: 7" in r.stderr
    frames = [line for line in r.stderr.splitlines() if line.strip().startswith("File ")]
    assert len(frames) == 2 and all('"/tmp/work/main.py"' in f for f in frames), r.stderr  # no frame of the server
    r = pool.run("import numpy as np; a = np.ones((200, 200)); print(int((a @ a).sum()))")
    assert (r.status, r.stdout) == ("ok", "8000000\n")


def test_bad_input_is_one_clear_error(pool):
    with pytest.raises(ValueError, match="argv is required"):
        pool.run({"a.py": ""})
    with pytest.raises(ValueError, match=r"inside the working dir.*\.\./x"):
        pool.run({"../x": ""}, ["true"])
    with pytest.raises(ValueError, match=r"disk_mb=64.*differ"):
        pool.run("print(1)", limits=Limits(disk_mb=64))
    with pytest.raises(ValueError, match="size"):
        SandboxPool(size=0)
    with pytest.raises(TypeError, match="preload"):
        SandboxPool(preload="math")


def test_infra_errors_come_from_the_harness_only(pool, monkeypatch, tmp_path):
    r = pool.run("import sys; sys.stderr.write('bwrap: Can\\'t mount proc\\n'); sys.exit(1)")
    assert r.status == "runtime_error"  # program output cannot fake an infra error
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("POSTTRAIN_BWRAP", str(fake))
    with SandboxPool(size=1, limits=FAST) as broken:
        r = broken.run("print(1)")
    assert (r.status, r.returncode) == ("infra_error", None) and "uid map" in r.reason, r
    monkeypatch.setenv("POSTTRAIN_BWRAP", "")  # pretend bwrap is not installed
    with pytest.raises(RuntimeError, match=r"bubblewrap.*apt-get install -y bubblewrap"):
        pool.run("print(1)")


def test_limits_are_the_tasks_own(pool):
    probe = "import resource as r\nprint([r.getrlimit(getattr(r, n)) for n in ('RLIMIT_CPU', 'RLIMIT_NPROC', 'RLIMIT_FSIZE')])"
    r = pool.run(probe, limits=Limits(cpu_s=1.5, max_procs=20, disk_mb=FAST.disk_mb))
    fsize = min(128 << 20, FAST.disk_mb << 20)  # launch.FILE_SIZE_LIMIT_BYTES or the disk, as a one-shot run
    assert r.stdout == f"[(2, 3), (20, 20), ({fsize}, {fsize})]\n"
    assert pool.run(probe).stdout.startswith("[(5, 6), (64, 64)")  # the next task gets its own again
    r = pool.run("while True: pass", limits=Limits(cpu_s=1, wall_s=10))
    assert (r.status, r.reason) == ("timeout", "cpu: exceeded cpu_s=1") and 0.8 < r.cpu_s < 3
    r = pool.run("import time; time.sleep(30)", limits=Limits(wall_s=0.5))
    assert (r.status, r.reason, r.returncode) == ("timeout", "wall: exceeded wall_s=0.5", None) and r.wall_s < 2
    r = pool.run("x = bytearray(10 * 2**30)")
    assert r.status == "memory_limit" and "MemoryError" in r.stderr and r.wall_s < 5
    forks = ("import os, time\nfor i in range(3):\n    if os.fork() == 0:\n        b = bytearray(60 << 20)\n"
             "        for j in range(0, len(b), 4096):\n            b[j] = 1\n        time.sleep(30)\n        os._exit(0)\n"
             "os.wait()")  # each fork under the per-process limit, together over: the host's PSS poll
    r = pool.run(forks, limits=Limits(cpu_s=10, wall_s=10, memory_mb=128))
    assert r.status == "memory_limit" and r.wall_s < 8, r
    r = pool.run("import sys\nfor _ in range(1600): sys.stdout.write('x' * 65536)", limits=Limits(max_output_bytes=1 << 20))
    assert (r.status, len(r.stdout)) == ("output_limit", 1 << 20) and r.wall_s < 5


def test_a_kill_request_that_arrives_after_its_task_ended_spares_the_next(pool):
    _server(pool)
    (w,) = pool.workers
    w._kill_task("output")  # as when a cap is hit just as the task exits: the server already answered
    r = pool.run("import time; time.sleep(0.2); print('survived')")
    assert (r.status, r.stdout, pool.workers) == ("ok", "survived\n", [w])


def test_fork_bombs_are_bounded_and_leave_nothing(pool):
    r = pool.run("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n"
                 "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)",
                 limits=Limits(wall_s=10, max_procs=20))
    n, errno = map(int, r.stdout.split())
    assert (r.status, errno) == ("ok", 11) and 10 <= n < 20
    r = pool.run("import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n    except OSError:\n"
                 "        pass", limits=Limits(wall_s=0.5, max_procs=32))
    assert (r.status, r.reason) == ("timeout", "wall: exceeded wall_s=0.5")
    assert _server(pool).children() == [] and pool.run("print(1)").stdout == "1\n"


def test_isolation_holds_inside_a_worker(pool, monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
        r = pool.run(code)
        assert r.status == "runtime_error" and "connected" not in r.stdout
        with SandboxPool(size=1, limits=Limits(network=True)) as online:  # control: the same code can connect
            assert online.run(code).stdout == "connected\n"
        listener.accept()[0].close()
    project = ROOT / "pyproject.toml"
    before = project.read_bytes()
    for path in (project, "/etc/hostname", "/etc/posttrain-escape", "/usr/posttrain-escape"):
        r = pool.run(f"open({str(path)!r}, 'a').write('pwned')")
        assert r.status == "runtime_error" and "Error" in r.stderr, path
    assert project.read_bytes() == before and not Path("/etc/posttrain-escape").exists()
    r = pool.run(f"import os\ntry:\n    print(os.listdir({str(ROOT)!r}))\nexcept OSError as e:\n    print('absent')")
    assert "pyproject.toml" not in r.stdout
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "hunter2")
    r = pool.run("import os\nprint(sorted(os.environ))\nfor p in ('/proc/1/environ', f'/proc/{os.getppid()}/environ',"
                 " f'/proc/{os.getppid()}/mem', f'/proc/{os.getppid()}/fd/3'):\n    try:\n        open(p).read()\n"
                 "        print('read', p)\n    except OSError as e:\n        print('denied')")
    assert r.status == "ok" and "hunter2" not in r.stdout and "read" not in r.stdout, r.stdout
    assert "'LANG', 'MALLOC_ARENA_MAX'" in r.stdout
    r = pool.run(IPC)
    assert r.stdout == "semget -1 1\nmq_open -1 1\n", r  # state that would outlive the task: denied


IPC = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
       "for name, args in (('semget', (7, 1, 0o1600)), ('mq_open', (b'/q', os.O_CREAT | os.O_RDWR, 0o600, None))):\n"
       "    print(name, getattr(libc, name)(*args), ctypes.get_errno())")


def _tree_pids(pool: SandboxPool) -> set[int]:
    pool.start(1)
    (w,) = pool.workers
    return {p.pid for p in psutil.Process(w.tree.pid).children(recursive=True)} | {w.tree.pid}


WALK = ("import os, time\nfor top in ('.', '/tmp', '/dev/shm'):\n    for d, dirs, files in os.walk(top):\n"
        "        print(d, oct(os.stat(d).st_mode & 0o7777), sorted(dirs), sorted(files))\n"
        "    print(os.listxattr(top), time.time() - os.stat(top).st_mtime < 60)\nprint(os.getcwd())")
PROCS = "import os\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (os.getpid(), os.getppid())))"
# (case, the task, what it prints when it did its thing, a probe of what it changed)
CARRY = [
    ("writes files", "import os\nopen('a.txt', 'w').write('x')\nopen('/tmp/t', 'w').write('x')\nopen('/dev/shm/s', 'w')"
     "\nos.makedirs('locked/in')\nos.chmod('locked', 0)\nfor _ in range(300):\n    os.mkdir('d')\n    os.chdir('d')\n"
     "os.symlink('/etc/passwd', '/tmp/link')\nos.setxattr('.', 'user.note', b'hi')\nos.utime('/tmp', (1, 1))\n"
     "os.chmod('/tmp/work', 0)\nprint('wrote')", "wrote", WALK),
    ("sets environment variables", "import os\nos.environ['PT_X'] = '1'\nos.putenv('PT_Y', '2')\nos.environ['PATH'] = '/x'"
     "\nprint(os.environ['PT_X'])", "1", "import os, subprocess\nprint(sorted(os.environ.items()))\n"
     "print(subprocess.run(['env'], capture_output=True, text=True).stdout)"),
    ("monkeypatches modules", "import math, json, sys, builtins\nmath.sqrt = lambda x: 42\njson.dumps = None\n"
     "sys.modules['evil'] = math\nbuiltins.len = lambda x: 0\nsys.path.insert(0, '/nowhere')\nprint(math.sqrt(4))", "42",
     "import math, json, sys\nprint(math.sqrt(16), json.dumps([1]), 'evil' in sys.modules, len('ab'), sys.path[:2])"),
    ("leaves a background process", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
     "        time.sleep(60)\n    os._exit(0)\nprint('bye')", "bye", PROCS),
    ("forks children it does not wait for", "import os, time\nfor _ in range(5):\n    if os.fork() == 0:\n"
     "        time.sleep(60)\nprint('forked')", "forked", PROCS),
    ("fills memory and /dev/shm", "b = bytearray(150 << 20)\nfor j in range(0, len(b), 4096):\n    b[j] = 1\n"
     "open('/dev/shm/big', 'wb').write(b'x' * (60 << 20))\nprint('filled')", "filled",
     "import os\nb = bytearray(150 << 20)\nfor j in range(0, len(b), 4096):\n    b[j] = 1\n"
     "st = os.statvfs('/dev/shm')\nprint(st.f_bavail * st.f_frsize >> 20)"),
    ("changes cwd, umask, rlimits, signals", "import os, resource, signal\nos.chdir('/')\nos.umask(0o777)\n"
     "resource.setrlimit(resource.RLIMIT_NOFILE, (10, 10))\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('set')",
     "set", "import os, resource, signal\nprint(os.getcwd(), os.umask(0o22), resource.getrlimit(resource.RLIMIT_NOFILE),"
     " signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))"),
    ("closes stdout and stderr", "import os\nprint('closing', flush=True)\nos.close(1)\nos.close(2)", "closing",
     "import sys\nprint('out')\nprint('err', file=sys.stderr)"),
]


@pytest.mark.parametrize("case,task,evidence,probe", CARRY, ids=[c[0] for c in CARRY])
def test_the_next_task_in_the_worker_sees_nothing_of_the_last(pool, case, task, evidence, probe):
    limits = Limits(cpu_s=5, wall_s=10, memory_mb=512)
    before = pool.run(probe, limits=limits)
    pids = _tree_pids(pool)
    r = pool.run(task, limits=limits)
    assert evidence in r.stdout, (case, r)
    after = pool.run(probe, limits=limits)
    assert before.status == after.status == "ok" and before.stdout, (case, before, after)
    assert (after.stdout, after.stderr) == (before.stdout, before.stderr), case
    assert _tree_pids(pool) == pids  # the same worker, and nothing of the task's processes beside it


def test_a_task_that_kills_or_stops_its_server_gets_a_fresh_worker(pool, monkeypatch):
    old = _server(pool).pid
    r = pool.run("import os, signal, time; os.kill(os.getppid(), signal.SIGKILL); time.sleep(30)")
    assert (r.status, r.returncode) == ("runtime_error", 137) and r.wall_s < 5
    r = pool.run("import os, signal; os.kill(-1, signal.SIGKILL)")
    assert (r.status, r.returncode) == ("runtime_error", 137)
    assert pool.run("print(1)").stdout == "1\n" and _server(pool).pid != old
    monkeypatch.setattr(fork_worker, "BACKSTOP_S", 0.5)
    old = _server(pool).pid
    r = pool.run("import os, signal, time; os.kill(os.getppid(), signal.SIGSTOP); time.sleep(30)", limits=Limits(wall_s=0.5))
    assert (r.status, r.reason) == ("timeout", "wall: exceeded wall_s=0.5") and r.wall_s < 3
    probe = "import os, resource\nprint(resource.getrlimit(resource.RLIMIT_STACK), os.getpriority(os.PRIO_PROCESS, 0))"
    before = pool.run(probe).stdout
    lower = ("import os, resource\npp = os.getppid()\nresource.prlimit(pp, resource.RLIMIT_STACK, (1 << 20, 1 << 20))\n"
             "os.setpriority(os.PRIO_PROCESS, pp, 15)\nprint(resource.prlimit(pp, resource.RLIMIT_STACK))")
    assert pool.run(lower).stdout == "(1048576, 1048576)\n" and pool.workers == []  # the server was changed: replaced
    assert pool.run(probe).stdout == before
    deep = "import os\nfor _ in range(2100):\n    os.mkdir('dd')\n    os.chdir('dd')\nprint('deep')"  # > PATH_MAX
    assert pool.run(deep).stdout == "deep\n" and pool.workers == []  # could not be wiped: replaced
    assert pool.run("import os; print(os.listdir('.'))").stdout == "['main.py']\n" and _server(pool).pid != old


def test_concurrent_tasks_from_threads_and_the_shared_pool():
    results = [None] * 8
    with SandboxPool(size=2, limits=FAST) as two:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, two.run(f"print({i} * {i})"))) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(two.workers) == 2
    assert [(r.status, r.stdout) for r in results] == [("ok", f"{i * i}\n") for i in range(8)]
    assert shared_pool(FAST) is shared_pool(Limits(disk_mb=FAST.disk_mb)) is not shared_pool(Limits(disk_mb=64))


def test_kill_all_ends_a_running_task_as_infra_error(pool):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", pool.run("import time; time.sleep(30)", limits=Limits(wall_s=30))))
    server = _server(pool)
    t.start()
    while not server.children():  # the task runs
        time.sleep(0.01)
    sandbox.kill_all()
    t.join(5)
    assert (box["r"].status, box["r"].reason) == ("infra_error", "sandbox killed because the parent is shutting down")
    assert pool.run("print(2)").stdout == "2\n"


PARENT = """
import sys
from envs.sandbox.workers import SandboxPool
pool = SandboxPool(size=1)
print(pool.run("print(1)").stdout.strip(), pool.workers[0].host_dir, flush=True)
import time; time.sleep(60)
"""


def test_parent_sigterm_removes_its_workers():
    child = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, host_dir = child.stdout.readline().split()
    tree = psutil.Process(child.pid).children(recursive=True)
    assert out == "1" and any(p.uids().real >= sandbox.UID_BASE for p in tree) and os.path.isdir(host_dir)
    child.send_signal(signal.SIGTERM)
    child.wait(timeout=20)
    time.sleep(0.2)
    assert not os.path.exists(host_dir) and [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    child.stdout.close(), child.stderr.close()
    assert procs.LIVE.keys().isdisjoint(p.pid for p in tree)


@pytest.mark.parametrize("files, argv, stdin, reason", [
    ("print('\ud800')", None, None, "file main.py is not valid text: surrogates not allowed"),
    ({}, ["bash", "-c", "echo '\ud800'"], None, "argument 2 is not valid text"),
    ({}, ["bash", "-c", "echo a\x00b"], None, "argument 2 contains a NUL byte"),
    ({}, ["bash", "-c", "echo " + "a" * 200_000], None, "the command line is 200014 bytes, over the 100000-byte"),
    ("print(input())", None, "\udcff", "stdin is not valid text"),
])
@pytest.mark.parametrize("runner", ["run", "pool"])
def test_programs_no_process_can_take_are_refused_as_runtime_errors(pool, files, argv, stdin, reason, runner):
    """A model's program with a lone surrogate or a NUL byte, or a command line over the kernel's limit, is the
    program's fault: runtime_error naming why, never an exception out of run (it was UnicodeEncodeError /
    ValueError) or an infra_error (E2BIG from the launcher: a policy could dodge a 0 with it)."""
    run = sandbox.run if runner == "run" else pool.run
    result = run(files, argv, limits=FAST, stdin=stdin)
    assert (result.status, result.returncode) == ("runtime_error", None)
    assert result.reason.startswith(reason) and result.stderr == f"cannot run: {result.reason}\n"
