"""A code-like env for bench/async_rl.py (not a benchmark): Arithmetic-v0 whose every step also waits `latency_s`
seconds of wall time in its worker, as a sandboxed test run does (no CPU used meanwhile: the latency of starting
a sandbox and running its tests, not their compute).

Id `_latency_env:SlowArithmetic-v0` (gymnasium's module:id form: env workers import this module from bench/, which
the bench puts on sys.path and the pool hands on to its workers)."""
from __future__ import annotations

import time

import gymnasium

from envs.tasks.arithmetic import ArithmeticEnv

ENV_ID = "_latency_env:SlowArithmetic-v0"


class SlowArithmeticEnv(ArithmeticEnv):
    """Arithmetic-v0 (its kwargs) plus `latency_s` (seconds, >= 0) slept in every step before scoring."""

    def __init__(self, *, latency_s: float = 0.5, **kwargs) -> None:
        if not latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0 seconds, got {latency_s!r}")
        self.latency_s, self._built = float(latency_s), False
        super().__init__(**kwargs)  # its golden self-check steps without the latency
        self._built = True

    def step(self, action: str):
        if self._built:
            time.sleep(self.latency_s)
        return super().step(action)


if "SlowArithmetic-v0" not in gymnasium.registry:
    gymnasium.register("SlowArithmetic-v0", entry_point=SlowArithmeticEnv, disable_env_checker=True)
