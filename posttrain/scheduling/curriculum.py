"""Difficulty curriculum per domain: a level that follows the recent pass rate, and mix weights that can follow
learning progress (Kanitscheider et al. 2021, arXiv:2106.14876; rules: docs/scheduling.md). The state is JSON."""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


WEIGHTINGS = ("fixed", "learning_progress")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurriculumConfig:
    """The `curriculum` section: a difficulty curriculum per domain (ReasoningGym-v0 levels).

    Attributes:
        enabled: the run config's switch; the class works either way.
        low: the pass-rate band's lower edge (0 <= low < high).
        high: the pass-rate band's upper edge (high <= 1).
        step: levels per move (>= 1).
        window: episodes in the rolling pass rate.
        min_episodes: episodes at a level before it may move (1..window).
        pass_threshold: reward that counts as a pass (partial credit below it does not).
        weighting: "fixed" | "learning_progress".
        lp_fast: the fast EMA rate of learning progress (lp_slow < lp_fast <= 1).
        lp_slow: the slow EMA rate (0 < lp_slow).
        lp_floor: weight share every domain keeps (> 0).
    """

    enabled: bool = False
    low: float = 0.2
    high: float = 0.8
    step: int = 1
    window: int = 64
    min_episodes: int = 32
    pass_threshold: float = 1.0
    weighting: str = "fixed"
    lp_fast: float = 0.5
    lp_slow: float = 0.1
    lp_floor: float = 0.1

    def __post_init__(self):
        checks = {"low/high": 0.0 <= self.low < self.high <= 1.0, "step": _is_int(self.step) and self.step >= 1,
                  "window": _is_int(self.window) and self.window >= 1,
                  "min_episodes": _is_int(self.min_episodes) and 1 <= self.min_episodes <= self.window,
                  "pass_threshold": 0.0 < self.pass_threshold <= 1.0, "weighting": self.weighting in WEIGHTINGS,
                  "lp_fast/lp_slow": 0.0 < self.lp_slow < self.lp_fast <= 1.0, "lp_floor": self.lp_floor > 0.0}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"curriculum: invalid {', '.join(bad)} in {self} (low < high in [0, 1]; step >= 1; "
                             f"1 <= min_episodes <= window; weighting in {WEIGHTINGS}; 0 < lp_slow < lp_fast <= 1)")


class DifficultyCurriculum:
    """Per-domain levels and weights.

    Args:
      domains: {domain: (start level, max level)}; max level 0: no curriculum, but a pass rate and LP weight.
      weights: {domain: base mix weight > 0}, same keys.
    Raises ValueError on mismatched keys, a start level outside [0, max], or a non-positive weight.
    """

    def __init__(self, domains: Mapping[str, tuple[int, int]], weights: Mapping[str, float],
                 config: CurriculumConfig = CurriculumConfig()):
        if not domains or set(domains) != set(weights):
            raise ValueError(f"curriculum: weights must name exactly the domains {sorted(domains)}, got {sorted(weights)}")
        for name, (level, top) in domains.items():
            if not (_is_int(level) and _is_int(top) and 0 <= level <= top):
                raise ValueError(f"curriculum: domain {name!r} start level {level!r} outside [0, max level {top!r}]")
            if not weights[name] > 0:
                raise ValueError(f"curriculum: domain {name!r} weight must be > 0, got {weights[name]!r}")
        self.config = config
        self.names = sorted(domains)
        self.max_levels = {n: int(domains[n][1]) for n in self.names}
        self.base_weights = {n: float(weights[n]) for n in self.names}
        self.levels = {n: int(domains[n][0]) for n in self.names}
        self.windows = {n: collections.deque(maxlen=config.window) for n in self.names}
        self.ema_fast: dict[str, float | None] = {n: None for n in self.names}
        self.ema_slow: dict[str, float | None] = {n: None for n in self.names}
        self.moves = {n: 0 for n in self.names}

    def update(self, rewards: Mapping[str, Sequence[float]]) -> dict[str, tuple[int, int]]:
        """Adds one step's rewards per domain; returns {domain: (old, new level)} of those that moved.

        Raises ValueError on an unknown domain."""
        unknown = sorted(set(rewards) - set(self.names))
        if unknown:
            raise ValueError(f"curriculum: rewards for unknown domain(s) {unknown}; known {self.names}")
        cfg, moved = self.config, {}
        for name in sorted(rewards):
            passes = [1 if float(r) >= cfg.pass_threshold else 0 for r in rewards[name]]
            if not passes:
                continue
            rate = sum(passes) / len(passes)
            fast, slow = self.ema_fast[name], self.ema_slow[name]
            self.ema_fast[name] = rate if fast is None else fast + cfg.lp_fast * (rate - fast)
            self.ema_slow[name] = rate if slow is None else slow + cfg.lp_slow * (rate - slow)
            window = self.windows[name]
            window.extend(passes)
            if len(window) < cfg.min_episodes:
                continue
            recent = sum(window) / len(window)
            old = self.levels[name]
            if recent > cfg.high:
                new = min(old + cfg.step, self.max_levels[name])
            elif recent < cfg.low:
                new = max(old - cfg.step, 0)
            else:
                new = old
            if new != old:
                self.levels[name], moved[name] = new, (old, new)
                self.moves[name] += 1
                window.clear()
        return moved

    def pass_rate(self, name: str) -> float | None:
        """Pass rate over `name`'s current window (None when empty)."""
        window = self.windows[name]
        return sum(window) / len(window) if window else None

    def learning_progress(self, name: str) -> float:
        """|fast EMA - slow EMA| of `name`'s batch pass rate (0 before its first episode)."""
        fast, slow = self.ema_fast[name], self.ema_slow[name]
        return 0.0 if fast is None else abs(fast - slow)

    def weights(self) -> dict[str, float]:
        """Mix weights: the base weights, or base * (lp_floor + LP / max LP) with "learning_progress"."""
        if self.config.weighting == "fixed":
            return dict(self.base_weights)
        lp = {n: self.learning_progress(n) for n in self.names}
        top = max(lp.values())
        if top <= 0.0:
            return dict(self.base_weights)
        return {n: self.base_weights[n] * (self.config.lp_floor + lp[n] / top) for n in self.names}

    def metrics(self) -> dict[str, float]:
        """`curriculum/<domain>/{level,pass_rate,learning_progress,weight,moves}` (pass_rate -1 when empty)."""
        out, weights = {}, self.weights()
        for n in self.names:
            rate = self.pass_rate(n)
            out.update({f"curriculum/{n}/level": float(self.levels[n]),
                        f"curriculum/{n}/pass_rate": -1.0 if rate is None else rate,
                        f"curriculum/{n}/learning_progress": self.learning_progress(n),
                        f"curriculum/{n}/weight": weights[n], f"curriculum/{n}/moves": float(self.moves[n])})
        return out

    def state_dict(self) -> dict:
        """JSON-serialisable state: levels, windows, EMAs and move counts per domain."""
        return {"domains": {n: {"level": self.levels[n], "window": list(self.windows[n]), "ema_fast": self.ema_fast[n],
                                "ema_slow": self.ema_slow[n], "moves": self.moves[n]} for n in self.names}}

    def load_state_dict(self, state: Mapping) -> None:
        """Restores `state_dict()` exactly; ValueError for other domains or a level above a domain's max."""
        saved = state.get("domains", {})
        if set(saved) != set(self.names):
            raise ValueError(f"checkpoint curriculum is for domains {sorted(saved)}, config has {self.names}")
        for n in self.names:
            s = saved[n]
            if not 0 <= int(s["level"]) <= self.max_levels[n]:
                raise ValueError(f"checkpoint curriculum level {s['level']} of {n!r} outside [0, {self.max_levels[n]}]")
            self.levels[n] = int(s["level"])
            self.windows[n] = collections.deque((int(x) for x in s["window"]), maxlen=self.config.window)
            self.ema_fast[n], self.ema_slow[n], self.moves[n] = s["ema_fast"], s["ema_slow"], int(s["moves"])


def from_env_specs(specs: Mapping[str, Mapping], config: CurriculumConfig = CurriculumConfig()) -> DifficultyCurriculum:
    """A curriculum over env specs; a ReasoningGym-v0 domain starts at its kwargs' ``level``, any other has level 0."""
    from envs.tasks import reasoning_gym
    domains, weights = {}, {}
    for name, spec in specs.items():
        get = spec.get if isinstance(spec, Mapping) else lambda k, d=None, s=spec: getattr(s, k, d)
        kwargs = dict(get("kwargs", {}) or {})
        top = reasoning_gym.max_level(kwargs["dataset"]) if get("id") == reasoning_gym.ENV_ID else None
        domains[name] = (int(kwargs.get("level") or 0) if top is not None else 0, top or 0)
        weights[name] = float(get("weight", 1.0))
    return DifficultyCurriculum(domains, weights, config)


