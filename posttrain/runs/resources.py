"""`Resources`: what a run opened, closed in reverse order with the first error kept (the GRPO loop, `GRPOTrainer`
and the commands that read a run)."""
from __future__ import annotations

from posttrain.infra import metrics as metrics_lib


class Resources:
    """What a run opened, as (name, close) pairs, closed in reverse order by `close` or on leaving the `with` block.

    A close that fails while an error propagates is logged and the next one still runs, so the first error is printed
    last; without an error in flight the first failing close is raised."""

    def __init__(self, *closers):
        self._closers = list(closers)

    def push(self, name: str, close) -> None:
        self._closers.append((name, close))

    def close(self, error: BaseException | None = None) -> None:
        first = None
        while self._closers:
            name, fn = self._closers.pop()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - every resource is closed; only the first error counts
                if error is None and first is None:
                    first = e
                else:
                    metrics_lib.log.warning("closing %s after %s failed too: %s: %s", name,
                                            type(error or first).__name__, type(e).__name__, e)
        if first is not None:
            raise first

    def __enter__(self) -> "Resources":
        return self

    def __exit__(self, typ, error, tb) -> None:
        self.close(error)

    def on_error(self):
        """A block that closes these resources only when it raises."""
        import contextlib

        @contextlib.contextmanager
        def block():
            try:
                yield self
            except BaseException as e:
                self.close(e)
                raise

        return block()
