"""What a sandbox can write (one capped tmpfs: cwd + /tmp + /dev/shm) and see (system folders, the
interpreter, allowed packages)."""
import os
import shutil
import socket
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from envs.sandbox import holder as _sandbox_holder

from envs import sandbox
from envs.sandbox import Limits, run

ROOT = Path(__file__).resolve().parents[3]
DISK = Limits(cpu_s=10, wall_s=20, disk_mb=16)
FILL = """
import errno, os, sys
targets, chunk, total, n = {targets!r}, b"x" * {chunk}, 0, 0
try:
    while True:
        for t in targets:
            with open(f"{{t}}/f{{n}}", "wb") as f:
                f.write(chunk)
            total += len(chunk)
            n += 1
except OSError as e:
    print(total, n, e.errno, flush=True)
{tail}
"""


@pytest.fixture(autouse=True)
def no_leaks_after_each_test():
    yield
    assert sandbox.find_leaks() == []
    if os.geteuid() == 0:  # no tmpfs left mounted in the holder's namespace
        with open(f"/proc/{_sandbox_holder.holder().pid}/mountinfo") as f:
            assert "posttrain-sbx" not in f.read()


def test_the_issues_720_mib_program_ends_as_a_disk_limit():
    r = run('for i in range(6): open(f"big{i}", "wb").write(b"\\1" * (120 << 20))', limits=DISK)
    assert (r.status, r.reason) == ("disk_limit", "disk: exceeded disk_mb=16 (cwd, /tmp and /dev/shm together)")


@pytest.mark.parametrize("targets,chunk,tail", [
    (["."], 1 << 20, ""),  # cwd, error caught, exit 0: still a disk limit
    (["/tmp"], 1 << 20, "sys.exit(1)"),
    (["/dev/shm"], 1 << 20, ""),
    ([".", "/tmp", "/dev/shm"], 1 << 20, ""),  # the three places share one cap
    ([".", "/tmp"], 4096, ""),  # many small files
    (["."], 0, ""),  # empty files: inodes are capped too (nr_inodes = disk / 4 KiB)
])
@pytest.mark.skipif(os.geteuid() != 0, reason="the total cap needs the root-mode holder namespace")
def test_everything_a_sandbox_writes_shares_one_cap(targets, chunk, tail):
    r = run(FILL.format(targets=targets, chunk=chunk, tail=tail), limits=DISK)
    total, _, err = map(int, r.stdout.split())
    assert (r.status, err) == ("disk_limit", 28) and total <= DISK.disk_mb << 20, r


@pytest.mark.skipif(os.geteuid() != 0, reason="the total cap needs the root-mode holder namespace")
def test_concurrent_sandboxes_stay_within_n_times_their_limits():
    n, stats, results = 3, [], [None] * 3
    code = FILL.format(targets=[".", "/tmp", "/dev/shm"], chunk=1 << 20, tail="import time; time.sleep(3)")
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(code, limits=DISK))) for i in range(n)]
    for t in threads:
        t.start()
    holder = _sandbox_holder.holder()
    seen = 0
    for _ in range(100):  # while they sleep, read every sandbox tmpfs from the holder's namespace
        with open(f"/proc/{holder.pid}/mountinfo") as f:
            points = [line.split()[4] for line in f if "posttrain-sbx" in line]
        full = [os.statvfs(holder.view(p)) for p in points if os.path.isdir(holder.view(p))]
        used = [(s.f_blocks - s.f_bfree) * s.f_frsize for s in full]
        if len(used) == n and all(u > (DISK.disk_mb - 1) << 20 for u in used):
            stats, seen = used, seen + 1
            break
        threading.Event().wait(0.05)
    for t in threads:
        t.join()
    assert seen and len(stats) == n and sum(stats) <= n * (DISK.disk_mb << 20)
    assert [r.status for r in results] == ["disk_limit"] * n


@pytest.fixture
def planted():
    """A secret file in fresh host directories outside the system folders (one beside the checkout)."""
    dirs = []
    for parent in (ROOT.parent, Path("/var/tmp"), Path("/opt"), Path("/srv"), Path("/mnt")):
        if os.access(parent, os.W_OK):
            dirs.append(Path(tempfile.mkdtemp(prefix="posttrain-answers-", dir=parent)))
            (dirs[-1] / "answers.txt").write_text("secret-42")
    yield dirs
    for d in dirs:
        shutil.rmtree(d)


def test_host_files_outside_the_needed_paths_are_invisible(planted):
    assert planted
    code = ("import os, sys\nfor d in sys.argv[1:]:\n    for p in (d, os.path.dirname(d)):\n        try:\n"
            "            print(p, sorted(os.listdir(p)))\n        except OSError as e:\n"
            "            print(p, type(e).__name__)\n"
            "    try:\n        print(open(d + '/answers.txt').read())\n    except OSError as e:\n"
            "        print(type(e).__name__)")
    r = run({"main.py": code}, [sandbox.PYTHON, "main.py", *map(str, planted)], limits=DISK)
    assert r.status == "ok" and "secret-42" not in r.stdout
    assert "answers.txt" not in r.stdout.replace("/answers.txt", "")  # never listed
    assert r.stdout.count("FileNotFoundError") >= len(planted), r.stdout
    r = run("import os; print(sorted(os.listdir('/')))", limits=DISK)
    visible = set(eval(r.stdout))  # noqa: S307 - our own program's repr
    assert not visible & {"home", "run", "srv", "opt", "var", "mnt", "sys", "media", "boot"}, visible


@pytest.mark.parametrize("module,importable", [("numpy", True), ("json", True), ("pytest", False), ("jax", False),
                                               ("envs", False), ("math_verify", False)])
def test_only_allowed_packages_are_importable(module, importable):
    r = run(f"import importlib.util; print(importlib.util.find_spec({module!r}) is not None)", limits=DISK)
    assert (r.status, r.stdout) == ("ok", f"{importable}\n")


def test_host_unix_sockets_are_unreachable():
    d = Path(tempfile.mkdtemp(prefix="posttrain-sock-", dir=ROOT.parent))
    name = f"posttrain-test-{uuid.uuid4().hex}"
    path_sock, abstract = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    try:
        path_sock.bind(str(d / "s.sock"))
        abstract.bind("\0" + name)
        for s in (path_sock, abstract):
            s.listen()
            s.settimeout(0.3)
        code = ("import socket\nfor a in ({!r}, {!r}):\n    try:\n        socket.socket(socket.AF_UNIX).connect(a)\n"
                "        print('connected')\n    except OSError as e:\n        print(type(e).__name__)")
        r = run(code.format(str(d / "s.sock"), "\0" + name), limits=DISK)
        assert r.status == "ok" and "connected" not in r.stdout and len(r.stdout.split()) == 2, r
        for s in (path_sock, abstract):
            with pytest.raises(socket.timeout):
                s.accept()
    finally:
        path_sock.close(), abstract.close()
        shutil.rmtree(d)


def test_bad_disk_limit_is_one_clear_error():
    with pytest.raises(ValueError, match="disk_mb"):
        Limits(disk_mb=0)
    with pytest.raises(TypeError, match="disk_mb"):
        Limits(disk_mb=1.5)
    with pytest.raises(ValueError, match="disk_mb"):
        sandbox.Workspace(disk_mb=-1)


SYSV = """
import ctypes, os, platform
libc = ctypes.CDLL(None, use_errno=True)
for name, args in (("shmget", (0, 64 << 20, 0o1600)), ("msgget", (0, 0o1600)), ("semget", (0, 1, 0o1600)),
                   ("mq_open", (b"/q", os.O_CREAT | os.O_RDWR, 0o600, None))):
    print(name, getattr(libc, name)(*args), ctypes.get_errno())
add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
print("add_key", libc.syscall(add_key, b"user", b"k", b"v", 1, -4), ctypes.get_errno())  # the user keyring
"""


def test_ram_no_limit_counts_is_out_of_reach():
    # System V shared memory and message queues: RAM outside every rlimit, so the calls are denied; so are
    # semaphores, POSIX message queues and keyrings (state the next program on the slot could read).
    r = run(SYSV, limits=DISK)
    assert (r.status, r.stdout) == ("ok", "".join(f"{n} -1 1\n" for n in ("shmget", "msgget", "semget", "mq_open",
                                                                         "add_key")))  # EPERM
    # POSIX shared memory lives in /dev/shm, on the sandbox's capped tmpfs: the second 10 MiB segment
    # does not fit in 16 MiB (touching its pages raises SIGBUS), and the run is a disk limit.
    code = ("from multiprocessing import shared_memory as sm\nfor i in range(2):\n"
            "    s = sm.SharedMemory(create=True, size=10 << 20)\n    s.buf[:] = b'x' * (10 << 20)\n"
            "    print('filled', flush=True)")
    r = run(code, limits=DISK)
    assert (r.status, r.stdout) == ("disk_limit", "filled\n"), r


@pytest.mark.parametrize("machine,length", [("x86_64", 13), ("aarch64", 12), ("riscv64", None)])
def test_seccomp_program_shape(machine, length):
    from envs.sandbox import launch as _sandbox_launch
    program = _sandbox_launch.seccomp_program(machine)
    assert (None if program is None else len(program) // 8) == length


TOUCH = "def touch(b):\n    for j in range(0, len(b), 4096):\n        b[j] = 1\n"
FORKS = TOUCH + ("import os, time\nfor i in range({n}):\n    if os.fork() == 0:\n        b = bytearray({mb} << 20)\n        touch(b)\n"
                 "        time.sleep(30)\n        os._exit(0)\nos.wait()\nprint('done')")
SHARED = TOUCH + ("import mmap, os, time\nm = mmap.mmap(-1, {mb} << 20)\nif os.fork() == 0:\n    time.sleep(30)\n"
                  "    os._exit(0)\ntouch(m)\ntime.sleep(3)\nprint('done')")


# Each fork keeps its buffer while it sleeps (a temporary freed after touching made the total a race between
# the forks and the memory poll: 1 run in 4 ended as "timeout" on 2 cores). The memory cases get a wall
# time far above what they need, so that reaching the cap never races the wall clock either; their forks
# sleep past it, so without the cap they would end as "timeout" (or "ok" for SHARED) and the test would fail.
@pytest.mark.parametrize("code,wall_s,status", [
    (FORKS.format(n=4, mb=120), 10, "memory_limit"),  # each fork under the per-process limit, together over
    (SHARED.format(mb=300), 10, "memory_limit"),  # shared anonymous memory: no RLIMIT_DATA counts it
    (TOUCH + "touch(bytearray(400 << 20))", 10, "memory_limit"),  # one process: RLIMIT_DATA
    (FORKS.format(n=2, mb=40), 2, "timeout"),  # under the limit: runs until its wall time
    (TOUCH + "touch(bytearray(150 << 20))\nprint('done')", 10, "ok"),
])
def test_the_memory_of_all_a_sandboxs_processes_is_capped(code, wall_s, status):
    r = run(code, limits=Limits(cpu_s=10, wall_s=wall_s, memory_mb=256))
    assert r.status == status and ("done" in r.stdout) == (status == "ok"), r


def test_concurrent_sandboxes_each_stay_within_their_memory():
    limits, results = Limits(cpu_s=10, wall_s=10, memory_mb=256), [None] * 3
    code = FORKS.format(n=4, mb=120)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(code, limits=limits))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status for r in results] == ["memory_limit"] * 3 and max(r.wall_s for r in results) < 5
