"""SIGINT / SIGTERM as a stop request (kind: an interruption saves the run's state and exits within 30 s): raised
at once outside a deferred block, at its end inside one, a second signal stops at once, the previous handlers come
back, a process stuck past the grace period exits with 128 + signum, and the CLI reports it in one line."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from posttrain.infra.distributed import RunInterrupted, StopRequest


def _send(name):
    os.kill(os.getpid(), getattr(signal, name))
    time.sleep(0.05)  # the handler runs at the next bytecode boundary


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("where", ["outside", "deferred"])
def test_first_signal_raises_run_interrupted_at_once_or_when_the_deferred_block_ends(name, where):
    before = {s: signal.getsignal(getattr(signal, s)) for s in StopRequest.SIGNALS}
    reached = []
    with pytest.raises(RunInterrupted) as info:
        with StopRequest() as stop:
            if where == "outside":
                _send(name)
                reached.append("after the signal")
            else:
                with stop.deferred():
                    _send(name)
                    reached.append("rest of the block")
                reached.append("after the block")
    assert info.value.signal_name == name and stop.signal_name == name
    assert reached == ([] if where == "outside" else ["rest of the block"])
    assert {s: signal.getsignal(getattr(signal, s)) for s in StopRequest.SIGNALS} == before


def test_a_second_signal_stops_at_once_without_saving():
    with pytest.raises(KeyboardInterrupt, match="second SIGTERM: stopping without saving") as info:
        with StopRequest() as stop:
            with stop.deferred():
                _send("SIGINT")
                _send("SIGTERM")
    assert type(info.value) is KeyboardInterrupt  # not a RunInterrupted: nothing is saved after it


def test_check_raises_once_a_signal_was_recorded():
    with StopRequest() as stop:
        stop.check()  # nothing received: no-op
        stop.signal_name = "SIGTERM"  # as the handler records it under several processes
        with pytest.raises(RunInterrupted):
            stop.check()


def test_a_process_stuck_past_the_grace_period_exits_with_128_plus_signum():
    """The main thread keeps working after the signal (as inside a long device computation): the watchdog, woken by
    the signal itself, ends the process after grace_s with one line on stderr."""
    code = textwrap.dedent("""
        import os, signal, time
        from posttrain.infra.distributed import StopRequest
        with StopRequest(grace_s=1.0) as stop:
            with stop.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                t = time.time()
                while time.time() - t < 60:
                    time.sleep(0.01)
        print("not reached")
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    t0 = time.time()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-2000:]
    assert "not reached" not in res.stdout and "did not stop within 1 s" in res.stderr.strip().splitlines()[-1]
    assert time.time() - t0 < 30


@pytest.mark.parametrize("name,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_the_cli_reports_an_interrupted_run_in_one_line_with_128_plus_signum(name, code, monkeypatch, capsys):
    from posttrain import cli

    def interrupted(f):
        raise RunInterrupted(name, f"{name}: stopped at step 3 (checkpoint 3 in runs/x/checkpoints); the same "
                                   "command resumes from it")

    monkeypatch.setitem(cli.COMMANDS, "train", interrupted)
    monkeypatch.setenv("POSTTRAIN_XLA_CACHE", "0")
    assert cli.main(["posttrain", "train"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"interrupted: {name}: stopped at step 3 (checkpoint 3 in runs/x/checkpoints); the same command "
                   "resumes from it"]
