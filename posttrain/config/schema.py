"""The GRPO run's `Config`: one section per component, each the component's own config type."""
from __future__ import annotations

import dataclasses

from posttrain.algos.grpo.step import GRPOConfig
from posttrain.checkpoints.orbax import CheckpointConfig
from posttrain.checkpoints.policy import ModelRunConfig
from posttrain.eval.runner import EvalConfig
from posttrain.rollout.env_side import EnvSpec  # noqa: F401  (an env.train / env.eval entry)
from posttrain.generate.backend import SamplingConfig
from posttrain.infra.mesh import MeshConfig
from posttrain.learn.learner import TrainConfig
from posttrain.learn.optim import OptimConfig
from posttrain.model.config import LoRAConfig
from posttrain.rollout.env_side import EnvConfig
from posttrain.rollout.queue import RolloutConfig
from posttrain.rollout.rewards import RewardsConfig
from posttrain.scheduling.curriculum import CurriculumConfig
from posttrain.scheduling.domain_rules import TasksConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run's configuration, one field per section of a `configs/*.py` file.

    Attributes:
        model: the policy's source and run settings (ModelRunConfig).
        mesh: the device mesh (MeshConfig).
        sampling: training rollouts (SamplingConfig).
        rl: the RL objective (GRPOConfig).
        optim: the optimizer and learning-rate schedule (OptimConfig).
        lora: low-rank adapters (`posttrain.model.config.LoRAConfig`; rank 0: none).
        env: the environment mix (EnvConfig).
        eval: held-out evaluation (EvalConfig).
        checkpoint: checkpoint saving (CheckpointConfig).
        train: steps, seed, workdir and stopping rules (TrainConfig).
        curriculum: the per-domain difficulty curriculum, off unless enabled (CurriculumConfig).
        tasks: task scheduling over many domains: policies, retries, quarantine, breaker (TasksConfig).
        rollout: how far the rollout phase runs ahead of the learner: the staleness bound (RolloutConfig).
        rewards: reward-model and LLM-judge rewards after the environment's (RewardsConfig; off by default)."""

    model: ModelRunConfig = ModelRunConfig()
    mesh: MeshConfig = MeshConfig()
    sampling: SamplingConfig = SamplingConfig()
    rl: GRPOConfig = GRPOConfig()
    optim: OptimConfig = OptimConfig()
    lora: LoRAConfig = LoRAConfig()
    env: EnvConfig = EnvConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    train: TrainConfig = TrainConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    tasks: TasksConfig = TasksConfig()
    rollout: RolloutConfig = RolloutConfig()
    rewards: RewardsConfig = RewardsConfig()
