"""One step's allocation of slots (prompts = groups) to domains: guarantees, priorities, caps, weights, credit.

Rules, for a call with `slots` slots over the candidate domains (those with a task to draw, not paused):
  1. Guarantee: each domain first gets g = floor(min_share x slots), cut to its hard cap (a max cap wins).
  2. Entitlement x (fractional groups): min(min_share x slots, rate cap) to start; the rest of the slots goes to
     priority levels in descending order, each level's share water-filled by weight up to the domains' rate caps,
     so a higher level is filled to its caps before a lower one gets anything beyond its guarantee. The rate cap
     is max_share x slots, cut to the integer caps on env CPU, concurrency and drawable tasks (what the domain can
     take this call), so that entitlements are feasible and sum to what is handed out.
  3. Integer counts by credit (deficit round robin): t = credit + x - g; a domain gets floor(t) more groups (within
     its hard cap); slots still free go one by one to the highest (priority, t - given, -name) with room, slots
     over-given (only when credits sum above 0) are taken back from the lowest. The new credit is t - given,
     clipped to +-max_credit. A domain that got less than its entitlement (fewer slots than domains, rounding,
     its share allowance used this call) carries the rest as credit and catches up in later calls: over k calls
     |groups - summed entitlement| < 1, so no domain with weight starves, however many domains share few slots.
Hard caps (integers, never exceeded): the share allowance (floor(max_share x slots + carry), the carry being the
fractional part left from the previous call, so k calls allow floor(k x max_share x slots) in all), floor(
max_env_cpu_s / group cost), (max_concurrency - samples in flight) // G, and 1 for a breaker's probe.

Worked example: 8 slots; "code" (priority 1, max_share 0.25, group cost 4 CPU s, max_env_cpu_s 12), "math"
(weight 3, min_share 0.25), "logic" (weight 1), all credits 0.
  guarantee: math 2 (0.25 x 8); code 0, logic 0.
  entitlement: math starts at 2; 6 slots left; level 1 = {code}: rate cap min(0.25 x 8, 12 / 4) = 2 -> code 2;
  4 left for level 0 = {math, logic} by weight 3:1 -> math 2 + 3 = 5, logic 1.
  counts: code floor(0 + 2) = 2, math 2 + floor(0 + 5 - 2) = 5, logic 1: 8 slots, credits all 0.
  With 300 one-weight domains and 8 slots, each earns 8/300 a call and gets a group every 37.5 calls on average.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

EPS = 1e-9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Claim:
    """One candidate domain's terms for one call (groups). weight > 0; priority: higher first; min_rate:
    min_share x slots; rate_cap: the entitlement's cap (max_share x slots cut to the integer caps); hard_cap:
    the integer cap this call (>= 0, the share allowance included); credit: carried from the last call."""

    weight: float
    priority: int = 0
    min_rate: float = 0.0
    rate_cap: float = math.inf
    hard_cap: int = 0
    credit: float = 0.0


def water_fill(budget: float, weights: Mapping[str, float], rooms: Mapping[str, float]) -> dict[str, float]:
    """Splits `budget` over the keys in proportion to `weights`, none above its room (max-min fair; a capped
    key's unused share goes to the others). Returns {key: amount}; the amounts sum to min(budget, sum(rooms))."""
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
    """Groups per domain for one call (module docstring). Returns (counts, new credits, entitlements); counts sum
    to min(slots, sum of hard caps). Raises ValueError for slots < 0 or a negative hard cap."""
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
    """(this call's share cap in groups, the carry for the next call): floor(max_share x slots + carry) and its
    fractional rest, so that k calls allow floor(k x max_share x slots) groups in all (max_share 1: all slots)."""
    if max_share >= 1.0:
        return slots, 0.0
    total = max_share * slots + carry
    cap = int(math.floor(total + EPS))
    return cap, max(0.0, total - cap)
