"""The checkpointer's unraisable hook: late tensorstore reads of a restore that failed (orbax's loop closed) are
silenced, and nothing else is."""
import asyncio
import sys
import types

from posttrain.checkpoints import orbax as orbax_lib


def test_late_reads_of_an_abandoned_restore_are_silenced_and_nothing_else(monkeypatch):
    """A tensorstore read finishing after a failed restore closed its event loop raises RuntimeError('Event loop is
    closed') in asyncio's _check_closed, printed as an unraisable traceback per array; the hook the Checkpointer
    installs drops exactly that and passes any other unraisable exception on."""
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(lambda: None)
    except RuntimeError as e:
        late = types.SimpleNamespace(exc_value=e, exc_traceback=e.__traceback__, exc_type=RuntimeError)
    other = RuntimeError("Event loop is closed")  # the same text raised elsewhere (no traceback into asyncio)
    try:
        raise other
    except RuntimeError as e:
        elsewhere = types.SimpleNamespace(exc_value=e, exc_traceback=e.__traceback__, exc_type=RuntimeError)
    passed = []
    monkeypatch.setattr(sys, "unraisablehook", passed.append)
    orbax_lib._quiet_late_read_callbacks()
    orbax_lib._quiet_late_read_callbacks()  # once per process: not wrapped twice
    assert sys.unraisablehook is not passed.append
    sys.unraisablehook(late)
    sys.unraisablehook(elsewhere)
    sys.unraisablehook(types.SimpleNamespace(exc_value=ValueError("x"), exc_traceback=None, exc_type=ValueError))
    assert [u.exc_value for u in passed] == [elsewhere.exc_value, passed[1].exc_value]
    assert isinstance(passed[1].exc_value, ValueError)
