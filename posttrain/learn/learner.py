"""The update phase: the train state, its jitted step, its checkpoints (stops and guards: docs/learner.md)."""
from __future__ import annotations

import ctypes
import dataclasses
import pathlib
import re
import time
from typing import Any, Callable, Mapping

import jax
import numpy as np

from posttrain.checkpoints.orbax import CheckpointConfig, Checkpointer
from posttrain.errors import AT_LEAST_ONE, NONNEGATIVE, check_fields
from posttrain.infra import distributed
from posttrain.infra import mesh as mesh_lib
from posttrain.infra import metrics as metrics_lib
from posttrain.learn import step as step_lib
from posttrain.learn.optim import OptimConfig
from posttrain.learn.state import create_train_state, model_states
from posttrain.types import RolloutBatch, TrainState

# (graphdef, optax transformation, lr schedule, the loaded model's ModelConfig) -> the pure step (state, batch)
StepBuilder = Callable[[Any, Any, Any, Any], Callable]
GUARD_FRACTION = 0.5  # a step boundary after a step of >= this x checkpoint.stop_grace_s gets a guard checkpoint


def guard_due(step_s: float, grace_s: float) -> bool:
    """True when the boundary after a step of `step_s` seconds needs a guard checkpoint (docs/learner.md)."""
    return step_s >= GUARD_FRACTION * grace_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerSettings:
    """What the update phase needs of a run.

    Attributes:
        workdir: the run's directory (checkpoints/ under it).
        optimizer: the config's optim section.
        total_steps: train steps of the run; the learning-rate schedule spans total_steps x updates_per_step
            optimizer updates (its clock is the update counter).
        lora_rank: train adapters only when > 0.
        need_reference: keep the initial policy for a KL term.
        seed: seeds the run's PRNG key.
        checkpointing: the config's checkpoint section.
        rules: logical-axis rules (`posttrain.infra.mesh.RULES` with the run's overlays).
        config_dict: the run's config as a plain dict, stored with every checkpoint.
        best_metric: also keep the checkpoint with the highest value of this metric (None: only the newest).
        updates_per_step: optimizer updates per train step (GRPO: rl.ppo_epochs x rl.minibatches)."""

    workdir: pathlib.Path
    optimizer: OptimConfig
    total_steps: int | None = None
    lora_rank: int = 0
    need_reference: bool = False
    seed: int = 0
    checkpointing: CheckpointConfig = CheckpointConfig()
    rules: tuple = mesh_lib.RULES
    config_dict: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    best_metric: str | None = None
    updates_per_step: int = 1

    def build_optimizer(self):
        """The run's optimizer, its schedule over every update of the run (`total_steps` x `updates_per_step`)."""
        return self.optimizer.build(self.total_steps * self.updates_per_step if self.total_steps else None)


def batch_shardings(mesh, batch: RolloutBatch | None = None, rules=mesh_lib.RULES,
                    batch_type: type = RolloutBatch) -> RolloutBatch:
    """NamedShardings splitting rows over the batch shards: of `batch`, or of `batch_type`'s fields by shape suffix."""
    if batch is not None:
        return jax.tree.map(lambda x: mesh_lib.batch_sharding(mesh, x.ndim, rules), batch)
    fields = {}
    for f in dataclasses.fields(batch_type):
        dims = re.fullmatch(r".+_([A-Za-z][a-z]?(?:x[A-Za-z][a-z]?)*)", f.name)
        if f.default is None:
            fields[f.name] = None
        elif dims is None:
            raise ValueError(f"{batch_type.__name__} field {f.name!r} needs a dimension suffix (e.g. _NxC) or a None default")
        else:
            fields[f.name] = mesh_lib.batch_sharding(mesh, len(dims.group(1).split("x")), rules)
    return batch_type(**fields)


def trim_host_heap() -> None:
    """Returns freed heap pages to the OS (glibc `malloc_trim`), so orbax's host copies do not peak on top of them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclasses.dataclass
class Learner:
    """The update phase of a run (docs/learner.md); `nonfinite_run`: consecutive skipped (non-finite) updates."""

    settings: LearnerSettings
    mesh: jax.sharding.Mesh
    model_config: Any  # posttrain.model.config.ModelConfig
    graphdef: Any  # nnx.GraphDef that merges `policy()`
    state: TrainState
    state_shardings: TrainState  # of NamedSharding
    batch_shardings: RolloutBatch  # of NamedSharding (None: optional field, placed as given)
    step_fn: Callable[[TrainState, RolloutBatch], tuple[TrainState, dict]]  # jitted, state donated
    checkpointer: Checkpointer
    nonfinite_run: int = 0
    boundary_t: float | None = None

    @classmethod
    def create(cls, settings: LearnerSettings, mesh, model_config, graphdef, weights,
               build_step: StepBuilder, *, read_only: bool = False, batch_type: type = RolloutBatch) -> "Learner":
        """A learner with a fresh train state from the loaded model and `build_step` (`read_only`: for run readers)."""
        opt = settings.build_optimizer()
        with jax.set_mesh(mesh):
            graphdef, state = create_train_state(graphdef, weights, opt.tx, jax.random.key(settings.seed),
                                                 lora_rank=settings.lora_rank,
                                                 need_reference=settings.need_reference)
        state_sh = jax.tree.map(lambda x: x.sharding, state)
        batch_sh = batch_shardings(mesh, rules=settings.rules, batch_type=batch_type)
        step_fn = step_lib.jit_step(build_step(graphdef, opt.tx, opt.lr_schedule, model_config), state_sh, batch_sh)
        c = settings.checkpointing
        ckpt = Checkpointer(settings.workdir / "checkpoints", every_steps=c.every_steps, keep=c.keep,
                            async_save=c.async_save, read_only=read_only,
                            best_metric=None if read_only else settings.best_metric)
        return cls(settings=settings, mesh=mesh, model_config=model_config, graphdef=graphdef, state=state,
                   state_shardings=state_sh, batch_shardings=batch_sh, step_fn=step_fn, checkpointer=ckpt)

    @property
    def step(self) -> int:
        """Completed train steps (the policy version): optimizer updates // `settings.updates_per_step`."""
        return int(self.state.step) // self.settings.updates_per_step

    @property
    def rng(self) -> jax.Array:
        """The run's PRNG key (the rollouter folds the step into it)."""
        return self.state.rng

    def policy(self) -> tuple:
        """The current policy's nnx states, in `graphdef`'s split order (adapters, base, rest under LoRA)."""
        return model_states(self.state.params, self.state.frozen)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One train step on a host batch; returns its metrics. A non-finite update is skipped and logged."""
        if self.boundary_t is None:
            self.boundary_t = time.monotonic()
        placed = jax.tree.map(distributed.global_array, batch, batch_shardings(self.mesh, batch, self.settings.rules))
        with jax.set_mesh(self.mesh):
            self.state, m = self.step_fn(self.state, placed)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        self.nonfinite_run = self.nonfinite_run + 1 if m.get("policy/skipped_nonfinite", 0.0) > 0 else 0
        if self.nonfinite_run:
            metrics_lib.log.warning("step %d: non-finite loss or gradient (loss=%s, grad_norm=%s): update skipped "
                                    "(%d in a row)", self.step, m.get("policy/loss"), m.get("optim/grad_norm"),
                                    self.nonfinite_run)
        return m

    def restore(self) -> dict | None:
        """Restores the newest usable checkpoint into `state`; returns its metadata (None: no checkpoint).

        Raises CheckpointCorruptError when no complete checkpoint is readable."""
        if self.checkpointer.latest_step() is None:
            return None
        self.state, meta = self.checkpointer.restore(None, self.state)
        return meta

    def save(self, rollout_state: Mapping, *, force: bool = False, metrics: Mapping | None = None) -> None:
        """Saves the state when due (or `force`); a call without `force` is a step boundary (guard checkpoints)."""
        scheduled, guard = self.checkpointer.should_save(self.step), False
        if not force:
            now = time.monotonic()
            step_s, self.boundary_t = now - (now if self.boundary_t is None else self.boundary_t), now
            guard = not scheduled and distributed.agree(guard_due(step_s, self.settings.checkpointing.stop_grace_s))
        if force or scheduled or guard:
            trim_host_heap()
            self.checkpointer.save(self.step, self.state, {**rollout_state, "config": dict(self.settings.config_dict)},
                                   force=force or guard, metrics=dict(metrics) if metrics else None,
                                   guard=guard)

    def stop_checkpoint(self, meta: Mapping, signal_name: str, start: int) -> distributed.RunInterrupted:
        """Saves the state on a stop signal (when past `start`) and returns the RunInterrupted to raise."""
        if self.step > start:
            self.save(meta, force=True)
            self.wait()
        return distributed.RunInterrupted(signal_name, f"{signal_name}: stopped at step {self.step} (checkpoint "
                                          f"{self.checkpointer.latest_step()} in {self.checkpointer.directory}); "
                                          "the same command resumes from it")

    def wait(self) -> None:
        """Blocks until pending (async) saves are on disk."""
        self.checkpointer.wait()

    def close(self) -> None:
        """Waits for pending saves and closes the checkpointer."""
        self.checkpointer.wait()
        self.checkpointer.close()


def abstract_batch(batch, mesh, rules=mesh_lib.RULES):
    """(ShapeDtypeStructs of a numpy RolloutBatch with the batch sharding, the shardings)."""
    shardings = jax.tree.map(lambda x: mesh_lib.batch_sharding(mesh, np.ndim(x), rules), batch)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=s),
                        batch, shardings), shardings


class NonFiniteError(RuntimeError):
    """Training stopped after `train.max_nonfinite_skips` consecutive non-finite steps."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The `train` section.

    Attributes:
        steps: train steps in the run.
        seed: seeds the init of presets, the task order and the sampling keys.
        workdir: the run's directory (--workdir overrides).
        max_train_seconds: stop after this much training time, in-loop evaluation not counted (0: no limit).
        max_nonfinite_skips: consecutive skipped (non-finite) steps that stop the run with an error, after a save.
        machine: the machine the config is written for ("": not stated): cpu-N:<G>GB, v5p-N, v5e-N, v6e-N or h200xN.
        preflight_prompt_len: prompt tokens of the pre-flight memory check (0: none); a step over 90% stops the run."""

    steps: int = 20
    seed: int = 0
    workdir: str = "runs/default"
    max_train_seconds: float = 0.0
    max_nonfinite_skips: int = 3
    machine: str = ""
    preflight_prompt_len: int = 128

    def __post_init__(self):
        check_fields(self, ranges={"steps": AT_LEAST_ONE, "max_nonfinite_skips": AT_LEAST_ONE,
                                   "max_train_seconds": NONNEGATIVE, "seed": NONNEGATIVE})
