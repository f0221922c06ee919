"""`posttrain rm`: train a reward model (Bradley-Terry on preference pairs; `posttrain.recipes.rm`).

  posttrain rm     --config=configs/rm_tiny.py [--workdir=DIR]   (a scalar head on the config's model)
  posttrain rm     --from_archive=RUN[,RUN] [--config=...] [--workdir=DIR]   (pairs from a GRPO run's groups: 1 over 0)
                   (prints the steps and the held-out rm/accuracy at the start and the end as one JSON line; the
                   model is exported to DIR/reward_model, what a GRPO run's rewards.model=DIR loads)
"""
from __future__ import annotations


def cmd_rm(f) -> int:
    """`posttrain rm --config=configs/rm_*.py | --from_archive=RUN [--workdir=DIR]`: reward-model training."""
    from posttrain.cli.commands import _offline
    from posttrain.config.rm import default_rm_config, rm_config_from_dict
    from posttrain.recipes import rm

    return _offline(f, "rm", default_rm_config, rm_config_from_dict, rm.make_rm_plan, rm.train, "rm/accuracy")
