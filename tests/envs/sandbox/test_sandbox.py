"""Escape suite for envs/sandbox.py: every case asserts the exact status and leaves nothing behind."""
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from envs.sandbox import procs
from envs import sandbox
from envs.sandbox import Limits, run

PROJECT_FILE = Path(__file__).resolve().parents[3] / "pyproject.toml"
FAST = Limits(cpu_s=5, wall_s=10)


@pytest.fixture(autouse=True)
def no_leaks_after_each_test():
    yield
    assert sandbox.find_leaks() == []


def test_hello_and_stdin_and_files():
    r = run("import sys; print(sys.stdin.read()[::-1])", stdin="olleh", limits=FAST)
    assert (r.status, r.returncode, r.stdout, r.reason) == ("ok", 0, "hello\n", "")
    r = run({"lib/util.py": "X = 41\n", "app.py": b"from lib.util import X\nprint(X + 1)\n"},
            [sandbox.PYTHON, "app.py"], limits=FAST)
    assert (r.status, r.stdout) == ("ok", "42\n")
    r = run({"a.sh": "echo hi; exit 3"}, ["bash", "a.sh"], limits=FAST)
    assert (r.status, r.returncode, r.stdout, r.reason) == ("runtime_error", 3, "hi\n", "exit code 3")


def test_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="argv is required"):
        run({"a.py": ""})
    with pytest.raises(ValueError, match=r"inside the working dir.*\.\./x"):
        run({"../x": ""}, ["true"])
    with pytest.raises(ValueError, match="relative path"):
        run({"/etc/x": ""}, ["true"])
    with pytest.raises(ValueError, match="isolation"):
        run("print(1)", isolation="none")
    with pytest.raises(ValueError, match="cpu_s"):
        Limits(cpu_s=0)
    with pytest.raises(TypeError, match="memory_mb"):
        Limits(memory_mb=1.5)


def test_import_numpy_and_blas_work():
    r = run("import numpy as np; a = np.ones((200, 200)); print(int((a @ a).sum()))", limits=FAST)
    assert (r.status, r.stdout) == ("ok", "8000000\n")


def test_fork_bomb_is_bounded_and_cleaned_up():
    r = run("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n"
            "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)",
            limits=Limits(wall_s=10, max_procs=20))
    n, errno = map(int, r.stdout.split())
    assert (r.status, errno) == ("ok", 11) and 10 <= n < 20  # EAGAIN once ~20 tasks exist
    t0 = time.monotonic()
    r = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            limits=Limits(wall_s=1.5, max_procs=32))
    assert (r.status, r.reason) == ("timeout", "wall: exceeded wall_s=1.5")
    assert time.monotonic() - t0 < 5 and sandbox.find_leaks() == []


def test_fork_bomb_with_setsid_children_dies_with_the_sandbox():
    r = run("import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n    except OSError:\n"
            "        pass", limits=Limits(wall_s=1.5, max_procs=32))
    assert (r.status, r.reason) == ("timeout", "wall: exceeded wall_s=1.5")
    assert sandbox.find_leaks() == []


def test_10gb_allocation_fails_fast():
    r = run("x = bytearray(10 * 2**30)", limits=FAST)
    assert r.status == "memory_limit" and "MemoryError" in r.stderr and r.wall_s < 5
    r = run("import numpy as np; x = np.ones(10 * 2**30 // 8)", limits=FAST)
    assert r.status == "memory_limit"


def test_cpu_spin_and_sleep_time_out_with_their_reason():
    r = run("while True: pass", limits=Limits(cpu_s=1, wall_s=10))
    assert (r.status, r.reason) == ("timeout", "cpu: exceeded cpu_s=1") and 0.8 < r.cpu_s < 3
    r = run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass",
            limits=Limits(cpu_s=1, wall_s=10))  # ignoring SIGXCPU only buys the 1 s to the hard limit
    assert (r.status, r.reason, r.returncode) == ("timeout", "cpu: exceeded cpu_s=1", 137)
    r = run("import time; time.sleep(30)", limits=Limits(wall_s=1))
    assert (r.status, r.reason, r.returncode) == ("timeout", "wall: exceeded wall_s=1", None) and r.wall_s < 3


def test_no_network_by_default():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
        r = run(code, limits=FAST)
        assert r.status == "runtime_error" and "connected" not in r.stdout and "Error" in r.stderr
        with pytest.raises(socket.timeout):
            listener.accept()
        r = run(code, limits=Limits(cpu_s=5, wall_s=10, network=True))  # control: the same code can connect
        assert (r.status, r.stdout) == ("ok", "connected\n")
        listener.accept()[0].close()


def test_cannot_write_the_checkout_or_etc():
    before = PROJECT_FILE.read_bytes(), Path("/etc/hostname").read_bytes()
    for path in (PROJECT_FILE, "/etc/hostname", "/etc/posttrain-escape"):
        r = run(f"open({str(path)!r}, 'a').write('pwned')", limits=FAST)
        assert r.status == "runtime_error" and "Error" in r.stderr, path
    assert (PROJECT_FILE.read_bytes(), Path("/etc/hostname").read_bytes()) == before
    assert not Path("/etc/posttrain-escape").exists()
    code = ("import os\nfor p in (%r, '/root'):\n    try:\n        print(p, os.listdir(p))\n"
            "    except OSError as e:\n        print(p, 'absent', type(e).__name__)" % str(PROJECT_FILE.parent))
    r = run(code, limits=FAST)  # the checkout (wherever it lies, /tmp included) is absent or empty inside
    assert r.status == "ok" and r.stdout.count("\n") == 2, (r.status, r.stdout, r.stderr)
    assert "pyproject.toml" not in r.stdout and ".ssh" not in r.stdout


def test_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "hunter2")
    r = run("import os\nprint(sorted(os.environ))\nfor p in ('/proc/1/environ', f'/proc/{os.getppid()}/environ'):\n"
            "    try:\n        print(open(p).read())\n    except OSError as e:\n        print('denied', p)", limits=FAST)
    assert r.status == "ok" and "hunter2" not in r.stdout and "POSTTRAIN_TEST_SECRET" not in r.stdout
    assert "'LANG', 'MALLOC_ARENA_MAX'" in r.stdout  # the minimal environment is there


def test_killing_the_parent_or_everything_is_contained():
    r = run("import os, signal, time; os.kill(os.getppid(), signal.SIGKILL); time.sleep(30)", limits=FAST)
    assert (r.status, r.returncode) == ("runtime_error", 137) and r.wall_s < 5
    r = run("import os, signal; os.kill(-1, signal.SIGKILL)", limits=FAST)
    assert (r.status, r.returncode) == ("runtime_error", 137)
    assert os.getppid() > 1  # we (and our parent) are still here


def test_100mb_of_stdout_is_cut_at_the_cap_fast_with_bounded_memory():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run("import sys\nfor _ in range(1600): sys.stdout.write('x' * 65536)", limits=Limits(max_output_bytes=1 << 20))
    assert (r.status, len(r.stdout)) == ("output_limit", 1 << 20) and r.wall_s < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50_000  # KiB


def test_daemon_is_gone_after_the_main_process_exits():
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(1)\n"
            "        open('daemon-was-here', 'w').write('x')\n        time.sleep(60)\n    os._exit(0)\nprint('bye')")
    with sandbox.Workspace() as ws:
        r = run(code, limits=FAST, workspace=ws)
        assert (r.status, r.stdout) == ("ok", "bye\n") and r.wall_s < 1
        time.sleep(1.5)
        assert not (ws.path / "daemon-was-here").exists()
        assert [leak for leak in sandbox.find_leaks() if leak.startswith("process")] == []


def test_soft_limits_are_clamped_to_hard_limits():
    # Lowering our own hard limit could not be undone (no CAP_SYS_RESOURCE), so do it in a child.
    code = ("import resource\nresource.setrlimit(resource.RLIMIT_NPROC, (100, 100))\nfrom envs import sandbox\n"
            "r = sandbox.run('import resource; print(resource.getrlimit(resource.RLIMIT_NPROC))',\n"
            "                limits=sandbox.Limits(cpu_s=5, wall_s=10, max_procs=10_000))\nprint(r.status, r.stdout)")
    child = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_FILE.parent, capture_output=True, text=True,
                           timeout=60)
    assert child.stdout == "ok (100, 100)\n\n", child.stderr


def test_missing_bubblewrap_refuses_unless_weak_is_explicit(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_BWRAP", "")  # pretend bwrap is not installed
    with pytest.raises(RuntimeError, match=r"bubblewrap.*apt-get install -y bubblewrap.*isolation='weak'"):
        run("print(1)", limits=FAST)
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "hunter2")
    r = run("import os; print(os.getpid() <= 3, 'POSTTRAIN_TEST_SECRET' in os.environ)", limits=FAST, isolation="weak")
    assert (r.status, r.stdout) == ("ok", "True False\n")  # own pid namespace, scrubbed environment


def test_infra_errors_come_from_the_harness_only(monkeypatch, tmp_path):
    r = run("import sys; sys.stderr.write('bwrap: Can\\'t mount proc\\n'); sys.exit(1)", limits=FAST)
    assert r.status == "runtime_error"  # program output cannot fake an infra error
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("POSTTRAIN_BWRAP", str(fake))
    r = run("print(1)", limits=FAST)
    assert (r.status, r.returncode) == ("infra_error", None) and "uid map" in r.reason
    monkeypatch.delenv("POSTTRAIN_BWRAP")
    monkeypatch.setattr(procs, "TMP_BASE", str(tmp_path / "missing"))
    r = run("print(1)", limits=FAST)
    assert r.status == "infra_error" and "could not create sandbox dir" in r.reason


PARENT = """
import os, signal, sys, time
from envs.sandbox import procs
from envs import sandbox
ws = sandbox.Workspace().__enter__()  # never closed by this script
if sys.argv[1] == "exit":
    print(ws.path, flush=True)
    sys.stdin.readline()
    sys.exit(0)
import threading
threading.Thread(target=sandbox.run, args=("import time; time.sleep(60)",), daemon=True).start()
while not procs.LIVE:
    time.sleep(0.01)
time.sleep(0.3)
print(ws.path, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["exit", "SIGTERM", "SIGINT"])
def test_parent_exit_or_signal_removes_its_sandboxes(how):
    import psutil

    child = subprocess.Popen([sys.executable, "-c", PARENT, how], cwd=PROJECT_FILE.parent, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workspace = Path(child.stdout.readline().strip())
    assert workspace.is_dir(), child.stderr.read()
    tree = psutil.Process(child.pid).children(recursive=True)
    if how == "exit":
        child.stdin.write("\n")
        child.stdin.flush()
    else:
        assert any(p.name() == "bwrap" for p in tree) and any(p.uids().real >= sandbox.UID_BASE for p in tree)
        child.send_signal(getattr(signal, how))
    child.wait(timeout=20)
    time.sleep(0.2)
    assert not workspace.exists() and list(Path(sandbox.TMP_BASE).glob(f"{sandbox.DIR_PREFIX}{child.pid}-*")) == []
    assert [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    child.stdin.close(), child.stdout.close(), child.stderr.close()


def test_fake_reward_file_and_symlinks_cannot_forge_the_checkers_verdict(tmp_path):
    expected = "42"  # verifier state: held by the host, never inside the workspace
    (tmp_path / "expected.txt").write_text(expected)
    program = (f"import json, os\njson.dump({{'reward': 1.0}}, open('reward.json', 'w'))\n"
               f"try:\n    print(open({str(tmp_path / 'expected.txt')!r}).read())\nexcept OSError:\n    print('hidden')\n"
               f"os.symlink({str(tmp_path / 'expected.txt')!r}, 'answer.txt')")

    def checker(ws: sandbox.Workspace) -> float:  # trusts only what it computes itself
        try:
            return float(ws.read_text("answer.txt").strip() == expected)
        except OSError:
            return 0.0

    with sandbox.Workspace() as ws:
        r = run(program, limits=FAST, workspace=ws)
        assert (r.status, r.stdout) == ("ok", "hidden\n")
        assert json.loads(ws.read_text("reward.json")) == {"reward": 1.0} and checker(ws) == 0.0
        run({"answer.txt": "42\n"}, ["true"], limits=FAST, workspace=ws)  # host write replaces the link
        assert checker(ws) == 1.0 and (tmp_path / "expected.txt").read_text() == expected


def test_hostile_workspace_contents_are_still_removed():
    code = ("import os\nos.makedirs('locked/inner')\nopen('locked/inner/f', 'w').close()\nos.chmod('locked/inner', 0)\n"
            "os.chmod('locked', 0)\nfor _ in range(1500):  # deeper than Python's recursion limit\n"
            "    os.mkdir('d')\n    os.chdir('d')\nprint('built')")
    with sandbox.Workspace() as ws:
        assert (run(code, limits=FAST, workspace=ws).stdout, (ws.path / "locked").exists()) == ("built\n", True)
        path = ws.path
    assert not path.exists()


def test_workspace_persists_across_runs_and_is_removed():
    with sandbox.Workspace() as ws:
        assert run({"a.txt": "1"}, ["sh", "-c", "cat a.txt > b.txt; echo 2 >> a.txt"], workspace=ws).status == "ok"
        r = run({}, ["sh", "-c", "cat a.txt b.txt; pwd"], limits=FAST, workspace=ws)
        assert (r.status, r.stdout) == ("ok", f"12\n1{sandbox.SANDBOX_CWD}\n")
        path = ws.path
    assert not path.exists() and path.parent.name.startswith(f"{sandbox.DIR_PREFIX}{os.getpid()}-")


def test_concurrent_runs_from_threads():
    results = [None] * 8

    def work(i):
        results[i] = run(f"print({i} * {i})", limits=FAST)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [(r.status, r.stdout) for r in results] == [("ok", f"{i * i}\n") for i in range(8)]


def test_kill_all_ends_running_sandboxes_as_infra_error():
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", run("import time; time.sleep(30)", limits=Limits(wall_s=30))))
    t.start()
    while not any(not tree.expected for tree in procs.LIVE.values()):  # a one-shot sandbox (not a persistent worker)
        time.sleep(0.01)
    time.sleep(0.2)
    sandbox.kill_all()
    t.join(5)
    assert (box["r"].status, box["r"].reason) == ("infra_error", "sandbox killed because the parent is shutting down")
