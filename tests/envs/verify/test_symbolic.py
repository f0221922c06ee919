"""Tests for envs/_verify_worker.py: symbolic comparison bounded in time from any thread or process."""
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from envs.verify import symbolic
from envs.verify import answers
ROOT = Path(__file__).resolve().parents[3]
HUGE = r"\binom{1000000000}{100000000}"  # sympy evaluates this for minutes


def _in_thread(fn):
    box = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "scoring did not return within 30 s"
    return box[0]


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_runaway_comparison_times_out_kills_its_worker_and_the_pool_recovers(where):
    pool = symbolic.pool()
    pool.compare("1", "1")  # warm
    killed = pool.killed
    t0 = time.monotonic()
    call = lambda: answers.score_math(rf"\boxed{{{HUGE}}}", "1", timeout_s=1.0)  # noqa: E731
    verdict = call() if where == "main" else _in_thread(call)
    assert time.monotonic() - t0 < 3.0
    assert (verdict.reward, verdict.status) == (0.0, "timeout") and "over 1 s" in verdict.reason
    assert pool.killed == killed + 1
    assert _in_thread(lambda: answers.answers_equivalent("2^{10}", "1024", timeout_s=30)) is True  # a replacement works


def test_answers_equivalent_is_bounded_from_another_process():
    code = (f"import time\nfrom envs.verify import answers\nanswers.answers_equivalent('1', '1+0')\nt0 = time.monotonic()\n"
            f"print(answers.answers_equivalent({HUGE!r}, '1', timeout_s=1.0), round(time.monotonic() - t0))")
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert child.stdout.split() == ["False", "1"], child.stderr[-2000:]


def test_concurrent_threads_share_the_pool():
    pairs = [("2^{10}", "1024", True), (r"\sqrt{8}", r"2\sqrt{2}", True), ("x+1", "x+2", False),
             (r"\frac{1}{2^{98}}", r"\frac{1}{2^{99}}", False)] * 2
    results = [None] * len(pairs)

    def work(i):
        results[i] = answers.answers_equivalent(pairs[i][0], pairs[i][1], timeout_s=30)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [same for _, _, same in pairs]
    assert symbolic.pool()._live <= symbolic.pool().size


def test_symbolic_equal_runs_in_process_and_failures_are_not_equal():
    assert symbolic.symbolic_equal(r"\frac{\pi}{2}", r"\frac{\pi}{2}") and not symbolic.symbolic_equal("3x", "3")
    assert symbolic.numbers_equal(0.5, 0.5) and not symbolic.numbers_equal(2 ** -98, 2 ** -99)
    assert symbolic.pool().compare("}{", "1") == (False, "")


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(ValueError, match="timeout_s"):
        symbolic.pool().compare("1", "1", timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s"):
        answers.answers_equivalent("1", "1", timeout_s=-1)
    with pytest.raises(ValueError, match="size"):
        symbolic.WorkerPool(0)


@pytest.mark.parametrize("reaped", [False, True])  # True: the request's write itself fails (broken pipe)
def test_a_worker_that_dies_is_an_infra_error_not_a_timeout(reaped):
    pool = symbolic.WorkerPool(1)
    try:
        assert pool.compare("1", "1") == (True, "")
        pool._idle[0].proc.kill()  # dies while idle: the next request finds it gone
        if reaped:
            pool._idle[0].proc.wait()
        equal, reason = pool.compare("2", "2", timeout_s=5)
        assert equal is None and reason.startswith("infra: verifier worker failed")
        assert pool.compare("x+1", "1+x", timeout_s=30) == (True, "")  # replaced
    finally:
        pool.close()


RUNAWAY = [HUGE, r"\binom{10^{9}}{10^{8}}", r"\binom{10^{12}}{10^{11}}+1"]  # sympy evaluates each for minutes
CALLERS = {  # every public scoring entry point -> (its result for a runaway answer, what it must be)
    "score_math": (lambda e: (lambda r: (r.reward, r.status))(answers.score_math(rf"\boxed{{{e}}}", "1", timeout_s=1.0)),
                   (0.0, "timeout")),
    "answers_equivalent": (lambda e: answers.answers_equivalent(e, "1", timeout_s=1.0), False),
    "compare_answers": (lambda e: answers.compare_answers(e, "1", timeout_s=1.0)[0], None),
}


@pytest.mark.parametrize("caller", list(CALLERS))
@pytest.mark.parametrize("expr", RUNAWAY)
def test_every_entry_point_is_bounded_off_the_main_thread(expr, caller):
    call, want = CALLERS[caller]
    symbolic.pool().compare("1", "1")  # warm: the bound is timeout_s plus at most a worker's start-up
    t0 = time.monotonic()
    assert _in_thread(lambda: call(expr)) == want
    assert time.monotonic() - t0 < 3.0
