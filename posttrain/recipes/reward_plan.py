"""The run plan's rewards settings: the config's `rewards` section (`posttrain.config.rewards`) as the rollout
phase's `RewardSettings` (`posttrain.rollout.rewards`), checked before any model load.

Called by `run_plan.make_run_plan` (which puts the result in `RunPlan.rewards`); kept in a module of its own so the
run plan stays one screenful per concern. The judge is a policy source like the policy and its reference: the
run's precision policy applies to it and to the reward model.
"""
from __future__ import annotations

from posttrain.checkpoints.policy import PolicySource
from posttrain.config import ConfigError
from posttrain.infra.precision import PrecisionPolicy
from posttrain.rollout.rewards import JudgeSettings, RewardSettings


def reward_settings(cfg, precision: PrecisionPolicy) -> RewardSettings | None:
    """The `RewardSettings` of `cfg.rewards` (a `Config`), None when neither a reward model nor a judge is used.
    Raises ConfigError naming rewards.model (no reward model there: no config.json, not a one-label
    *ForSequenceClassification) or rewards.judge (an unknown preset, a bad path, overrides without a preset)."""
    r = cfg.rewards
    if not r.enabled:
        return None
    fields = dict(dtype=precision.compute_dtype, param_dtype=precision.param_dtype,
                  matmul_precision=precision.matmul_precision)
    if r.model:
        from posttrain.checkpoints.reward_model import reward_model_dir

        try:
            reward_model_dir(r.model)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"rewards.model={r.model!r}: {' '.join(str(e).split())}") from None
    judge = None
    if r.judge.enabled:
        j = r.judge
        source = PolicySource(path=j.path, preset=j.preset, overrides=dict(j.overrides), seed=cfg.train.seed,
                              fields=fields)
        try:
            source.check()
        except ValueError as e:
            message = " ".join(str(e).split()).replace("model.", "rewards.judge.")
            raise ConfigError(f"rewards.judge: {message}") from None
        judge = JudgeSettings(source=source, template=j.template,
                              criteria=tuple((c["name"], float(c["weight"]), c["description"]) for c in j.criteria),
                              max_score=float(j.max_score), max_new_tokens=j.max_new_tokens, batch_size=j.batch_size,
                              unparsable_score=float(r.judge_unparsable_score))
    return RewardSettings(model_path=r.model, model_fields=fields, judge=judge, weights=dict(r.weights),
                          batch_size=r.batch_size, max_len=r.max_len)
