"""The off-policy rule of the run plan (`posttrain.recipes.run_plan`): what the loss becomes when the rollout
queue may hand the learner batches sampled by older policies (`rollout.max_staleness > 0`, `posttrain.rollout.queue`).
"""
from __future__ import annotations

import dataclasses

from posttrain.config import Config, ConfigError

OFF_POLICY_TIS_CAP = 2.0  # rl.tis_cap = -1 at rollout.max_staleness > 0 (the cap C of Yao et al. 2025's TIS)


def off_policy_defaults(cfg: Config) -> tuple[Config, str | None]:
    """(`cfg` with rl.tis_cap = -1 resolved, a warning or None): the off-policy rule. With rollout.max_staleness > 0
    a batch may be sampled by an older policy than the one it trains, so the loss is PPO-clip on the decoupled
    ratio (`rl.loss` "ppo": the ratio's denominator is the trainer's own logprob, the proximal policy of AReaL's
    decoupled PPO, arXiv 2505.24298) weighted by the truncated importance weight min(pi_old / pi_sampler, C)
    (`rl.tis_cap`, C = OFF_POLICY_TIS_CAP); at 0, tis_cap = -1 is off. A value the config sets wins; an
    explicit tis_cap = 0 at max_staleness > 0 (no correction of the lag) is warned about. Raises ConfigError for
    max_staleness > 0 or rollout.stream_chunk > 0 under several processes (the producer thread's env exchanges
    would interleave with the learner's collectives)."""
    import jax

    k, rl = cfg.rollout.max_staleness, cfg.rl
    if k > 0 and jax.process_count() > 1:
        raise ConfigError(f"rollout.max_staleness={k} needs one process (this run has {jax.process_count()}): the "
                          "rollout producer's env exchanges would interleave with the learner's collectives; set "
                          "rollout.max_staleness=0")
    if cfg.rollout.stream_chunk > 0 and jax.process_count() > 1:
        raise ConfigError(f"rollout.stream_chunk={cfg.rollout.stream_chunk} needs one process (this run has "
                          f"{jax.process_count()}): streamed env steps would run the env runner's exchanges from a "
                          "second thread; set rollout.stream_chunk=0")
    warning = None
    if k > 0 and rl.tis_cap == 0:
        warning = (f"rollout.max_staleness={k} with rl.tis_cap=0: samples up to {k} policy versions old are trained "
                   "without importance correction (unclipped off-policy updates diverge); leave rl.tis_cap at -1 "
                   f"(C={OFF_POLICY_TIS_CAP}) or set a cap")
    if k > 0 and rl.loss != "ppo":
        warning = (f"rollout.max_staleness={k} with rl.loss={rl.loss!r}: the off-policy default is 'ppo' (PPO-clip "
                   "on the decoupled ratio); the TIS weight (rl.tis_cap) still corrects the lag") if warning is None \
            else warning
    if rl.tis_cap == -1:
        cfg = dataclasses.replace(cfg, rl=dataclasses.replace(rl, tis_cap=OFF_POLICY_TIS_CAP if k > 0 else 0.0))
    return cfg, warning
