"""One step's allocation of slots (groups) to domains: guarantees, then entitlements water-filled by priority and
weight, then integer counts by credit (deficit round robin) under hard caps (rules, example: docs/scheduling.md)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

EPS = 1e-9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Claim:
    """One candidate domain's terms for one call, in groups (min_rate: min_share x slots; hard_cap: >= 0)."""

    weight: float
    priority: int = 0
    min_rate: float = 0.0
    rate_cap: float = math.inf
    hard_cap: int = 0
    credit: float = 0.0


def water_fill(budget: float, weights: Mapping[str, float], rooms: Mapping[str, float]) -> dict[str, float]:
    """Splits `budget` over the keys by `weights`, none above its room (max-min fair); sums to min(budget, rooms)."""
    out = {k: 0.0 for k in weights}
    active = {k for k in weights if rooms[k] > EPS}
    while budget > EPS and active:
        total = sum(weights[k] for k in active)
        level = budget / total
        capped = {k for k in active if rooms[k] - out[k] <= level * weights[k] + EPS}
        if not capped:
            for k in active:
                out[k] += level * weights[k]
            break
        for k in sorted(capped):
            budget -= rooms[k] - out[k]
            out[k] = rooms[k]
        active -= capped
    return out


def entitlements(claims: Mapping[str, Claim], slots: int) -> dict[str, float]:
    """Rule 2: fractional groups per domain (sum <= slots)."""
    x = {d: min(c.min_rate, c.rate_cap) for d, c in claims.items()}
    budget = slots - sum(x.values())
    for level in sorted({c.priority for c in claims.values()}, reverse=True):
        names = [d for d, c in claims.items() if c.priority == level]
        extra = water_fill(budget, {d: claims[d].weight for d in names},
                           {d: max(0.0, claims[d].rate_cap - x[d]) for d in names})
        for d, v in extra.items():
            x[d] += v
        budget -= sum(extra.values())
        if budget <= EPS:
            break
    return x


def allocate(claims: Mapping[str, Claim], slots: int, max_credit: float = 4.0
             ) -> tuple[dict[str, int], dict[str, float], dict[str, float]]:
    """Returns (groups per domain, new credits, entitlements); ValueError for slots < 0 or a negative hard cap."""
    if slots < 0 or any(c.hard_cap < 0 for c in claims.values()):
        raise ValueError(f"allocate: slots {slots} and hard caps {[c.hard_cap for c in claims.values()]} must be >= 0")
    guaranteed = {d: min(int(math.floor(c.min_rate + EPS)), c.hard_cap) for d, c in claims.items()}
    x = entitlements(claims, slots)
    owed = {d: claims[d].credit + x[d] - guaranteed[d] for d in claims}
    room = {d: claims[d].hard_cap - guaranteed[d] for d in claims}
    extra = {d: min(max(0, int(math.floor(owed[d] + EPS))), room[d]) for d in claims}
    target = min(slots - sum(guaranteed.values()), sum(room.values()))

    def rank(d):  # who gets a free slot first (highest) / gives one back first (lowest)
        return (claims[d].priority, owed[d] - extra[d], tuple(-ord(ch) for ch in d))

    while sum(extra.values()) > target:
        d = min((d for d in claims if extra[d] > 0), key=rank)
        extra[d] -= 1
    while sum(extra.values()) < target:
        d = max((d for d in claims if extra[d] < room[d]), key=rank)
        extra[d] += 1
    counts = {d: guaranteed[d] + extra[d] for d in claims}
    credits = {d: min(max_credit, max(-max_credit, owed[d] - extra[d])) for d in claims}
    return counts, credits, x


def share_allowance(max_share: float, slots: int, carry: float) -> tuple[int, float]:
    """Returns (this call's share cap in groups, the carry for the next call): floor(max_share x slots + carry)."""
    if max_share >= 1.0:
        return slots, 0.0
    total = max_share * slots + carry
    cap = int(math.floor(total + EPS))
    return cap, max(0.0, total - cap)
