"""Reading a run of any kind posttrain writes (GRPO, SFT, DPO, reward model; LoRA or full) for the commands that
only read one (`eval`, `sample`, `convert`, `status`): the run's saved config.json is the source of truth, and a
command that cannot apply to a run kind refuses with one line naming why (a ConfigError: exit code 2).

The kind is the saved config's recipe section: `sft`, `dpo` or `rm` (the offline recipes' own section beside the
shared ones), else GRPO (`rl`). What each command reads:

  kind  | eval                                  | sample           | convert                         | status
  grpo  | its config (`run_plan.config_for_run`)| its policy       | its policy (HF causal LM)       | its view
  sft   | `policy_eval_config`                  | its policy       | its policy (HF causal LM)       | refused
  dpo   | `policy_eval_config`                  | its policy       | its policy (HF causal LM)       | refused
  rm    | refused (it scores, it has no policy) | refused          | HF sequence classifier          | refused

An SFT or DPO run has no environment of its own: `eval` takes the env and eval sections from --config, else from
the GRPO run it was trained from (`<section>.from_archive`, that run's config.json), else refuses naming --config
(`eval --suite` then takes the defaults: a suite evaluation builds only the suite's envs); the policy's shape and
state (`model`, `lora`, `optim`, `checkpoint`) are always the run's.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

from posttrain.config import Config, ConfigError

OFFLINE_KINDS = ("sft", "dpo", "rm")
# the sections an offline run's checkpoint is shaped by (params, adapters, optimizer state) and saved with
OFFLINE_STATE_SECTIONS = ("model", "lora", "optim", "checkpoint")
KIND_NAMES = {"sft": "an SFT run (posttrain sft)", "dpo": "a DPO run (posttrain dpo)",
         "rm": "a reward-model run (posttrain rm)", "grpo": "a GRPO run (posttrain train)"}


def run_kind(workdir) -> str | None:
    """"grpo", "sft", "dpo" or "rm": the kind of the run in `workdir` by its saved config.json's sections (None
    without one). Raises ConfigError naming the file when it is no JSON object."""
    path = pathlib.Path(workdir) / "config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a run's config.json holds an object, not {type(raw).__name__}")
    return kind_of(raw)


def kind_of(raw: dict) -> str:
    """"grpo", "sft", "dpo" or "rm": the kind of a run by the sections of its parsed config.json."""
    return next((k for k in OFFLINE_KINDS if k in raw), "grpo")


def refuse(workdir, kind: str, command: str, why: str):
    """The one-line ConfigError of a command that does not apply to the run kind."""
    return ConfigError(f"--checkpoint={workdir} is {KIND_NAMES[kind]}: {command} {why}")


def offline_plan(workdir, kind: str):
    """The plan (`recipes.<kind>.make_<kind>_plan`) of the offline run in `workdir` from its saved config.json,
    with its workdir. Raises ConfigError naming the file when it does not load."""
    from posttrain.config import dpo, rm, sft
    from posttrain.recipes import dpo as dpo_recipe, rm as rm_recipe, sft as sft_recipe

    load, make = {"sft": (sft.sft_config_from_dict, sft_recipe.make_sft_plan),
                  "dpo": (dpo.dpo_config_from_dict, dpo_recipe.make_dpo_plan),
                  "rm": (rm.rm_config_from_dict, rm_recipe.make_rm_plan)}[kind]
    path = pathlib.Path(workdir) / "config.json"
    try:
        cfg = load(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {' '.join(str(e).split())}") from None
    return make(cfg, workdir=str(workdir))


# a suite evaluation's stand-in for the env section of an SFT / DPO run that has none: never built (the suite's envs
# are all a suite evaluation builds, `grpo.build(held_out=False)`) nor written anywhere
SUITE_PLACEHOLDER_ENV = {"id": "posttrain/Arithmetic-v0"}


def policy_eval_config(workdir, kind: str, cfg: Config | None, suite: bool = False) -> Config:
    """The GRPO Config that evaluates the policy of the SFT / DPO run in `workdir`: `cfg`'s sections (else those of
    the GRPO run it was trained from; else, for a `suite` evaluation, which uses no env of the run, the defaults with
    SUITE_PLACEHOLDER_ENV as env.train) with the run's OFFLINE_STATE_SECTIONS and its workdir, and a learner shaped
    like the run's (no reference copy, one update per step). Raises ConfigError when none gives an env."""
    from posttrain.recipes.run_plan import saved_config

    saved = json.loads((pathlib.Path(workdir) / "config.json").read_text())
    source = saved.get(kind, {}).get("from_archive") or ""
    base = cfg
    if base is None and source and run_kind(source) == "grpo":
        base = saved_config(source)
    if base is None and suite:
        from posttrain.config import EnvSpec

        base = dataclasses.replace(Config(), env=dataclasses.replace(
            Config().env, train={"suite_placeholder": EnvSpec(**SUITE_PLACEHOLDER_ENV)}))
    if base is None:
        raise refuse(workdir, kind, "eval", "needs an env to evaluate on: pass --config=configs/X.py (its env and "
                     "eval sections; the run's model and weights are used), or --suite" +
                     (f" (its from_archive run {source!r} has no GRPO config.json)" if source else ""))
    from posttrain.config import from_config_dict, to_dict

    own = offline_plan(workdir, kind).config_dict  # validated; the sections as the run saved them

    raw = to_dict(base)
    raw.update({s: own[s] for s in OFFLINE_STATE_SECTIONS})
    raw["rl"].update(beta=0.0, ppo_epochs=1, minibatches=1)  # the offline learner's state: no reference copy
    raw["train"]["workdir"] = str(workdir)
    return from_config_dict(raw)


def reading_config(workdir, cfg: Config | None = None, command: str = "eval", suite: bool = False) -> Config:
    """The GRPO Config with which `command` evaluates the policy of the run in `workdir` (a complete checkpoint
    there is the caller's check): a GRPO run's `run_plan.config_for_run`, an SFT / DPO run's `policy_eval_config`
    (`suite`: for a suite evaluation, which needs no env of the run). Raises ConfigError for a reward-model run (it
    has no policy) or a run without a usable config."""
    from posttrain.recipes.run_plan import config_for_run

    kind = run_kind(workdir)
    if kind == "rm":
        raise refuse(workdir, kind, command, "evaluates a policy; a reward model scores replies (use it as "
                     f"rewards.model={workdir} in a GRPO config)")
    if kind in OFFLINE_KINDS:
        return policy_eval_config(workdir, kind, cfg, suite)
    return config_for_run(workdir, cfg)


def offline_model(workdir, kind: str):
    """(ModelConfig, nnx state, tokenizer) of the newest checkpoint of the offline run in `workdir` (LoRA
    unmerged; a reward model with its head), read only. Raises RunNotFoundError without a complete checkpoint."""
    from flax import nnx

    from posttrain.checkpoints.policy import load_policy
    from posttrain.infra import mesh as mesh_lib
    from posttrain.infra.partitioning import use_rules
    from posttrain.learn.learner import Learner
    from posttrain.learn.state import merge_model
    from posttrain.recipes.grpo import require_checkpoint

    require_checkpoint(workdir)
    plan = offline_plan(workdir, kind)
    with use_rules(plan.rules):
        mesh = mesh_lib.make_mesh(plan.mesh_shape)
        model_config, graphdef, weights, tokenizer = load_policy(plan.policy, mesh, plan.rules)
        kw = {}
        if kind == "rm":
            from posttrain.algos.rm.step import RewardBatch
            from posttrain.model.reward_head import with_head

            graphdef, weights = with_head(model_config, graphdef, weights, mesh, plan.rules, seed=plan.learner.seed)
            kw["batch_type"] = RewardBatch
        never_run = lambda *a: (lambda state, batch: (state, {}))  # noqa: E731 (reading: no step is taken)
        learner = Learner.create(plan.learner, mesh, model_config, graphdef, weights, never_run, read_only=True, **kw)
        try:
            learner.restore()
            s = learner.state
            return model_config, nnx.state(merge_model(learner.graphdef, s.params, s.frozen)), tokenizer
        finally:
            learner.close()
