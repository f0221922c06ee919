"""The `rollout` section of a run config: how far the rollout phase may run ahead of the learner
(`posttrain.rollout.queue`).

Kept beside `schema.py` (which imports it into `Config`); validated here (one ValueError naming the key, turned
into a ConfigError at load). The off-policy rule that goes with it (the default loss at `max_staleness > 0`:
PPO-clip on the decoupled ratio with `rl.tis_cap` on) is the run plan's (`posttrain.runs.plan`).

Example (a config file)::

    c.rollout.max_staleness = 1   # batch s may be sampled with policy version s - 1 (one-step off-policy)
    c.rollout.stream_chunk = 8    # every 8 decode steps the finished samples go to the env runner

Every field is a `posttrain.rollout.rollouter.RolloutSettings` field of the same name (the run plan copies them).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """The `rollout` section.

    Attributes:
        max_staleness: the most policy versions a trained sample may lag the learner: the rollouts of step s
            (trained by update s + 1, the learner at version s) are sampled with a version v >= s - max_staleness,
            so the producer runs at most max_staleness + 1 batches ahead (0: every batch is sampled with the
            policy it trains, the synchronous loop exactly; AReaL's bound, arXiv 2505.24298). An int >= 0.
        stream_chunk: streaming scoring (`posttrain.generate.streaming`): every stream_chunk decode steps the samples
            that have finished decoding go to the env runner while the others still decode, so env time overlaps
            decoding; the samples, rewards and batches are the same as without it (0: off, the envs get a turn's
            samples once all have decoded). An int >= 0; one process only.
        partial: partial rollouts (issue 24 item 3): weights published by the learner while a batch still decodes
            go into the running rollout engine at its next decode chunk, so a long reply continues under the new
            policy instead of holding the batch back; each token records the version that produced it, a sample
            counts as its oldest token's version for staleness, and the loss corrects token by token (the
            sampler's logprob of each token is its behaviour policy). Needs max_staleness >= 1 and the
            rollout engine (sampling.backend "engine", or "auto" on one device; a ConfigError otherwise).
        sampler_priority: with max_staleness >= 1 on the learner's own devices, an update waits for a generation
            call in progress to end before it starts (`RolloutQueue.yield_to_sampler`; perf/sampler_wait_s), so
            the sampler, the producer's critical path, does not share the cores or the accelerator with an update
            it started beside; updates never delay a generation (a generation starting during an update runs
            beside it). Off (no effect) at max_staleness 0, with partial rollouts (a generation then spans
            updates by design) and with split meshes (`mesh.rollout`: the sampler has devices of its own).
    """

    max_staleness: int = 0
    stream_chunk: int = 0
    partial: bool = False
    sampler_priority: bool = True

    def __post_init__(self):
        v = self.max_staleness
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"rollout.max_staleness={v!r}: an int >= 0 (0: synchronous)")
        v = self.stream_chunk
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"rollout.stream_chunk={v!r}: an int >= 0 (decode steps between deliveries; 0: off)")
        if not isinstance(self.sampler_priority, bool):
            raise ValueError(f"rollout.sampler_priority={self.sampler_priority!r}: True or False")
        if self.partial and self.max_staleness < 1:
            raise ValueError(f"rollout.partial=True needs rollout.max_staleness >= 1 (weights that change during a "
                             f"batch make it off-policy), got {self.max_staleness}")
