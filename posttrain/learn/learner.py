"""The update phase: the train state, its jitted step with explicit in/out shardings, and its checkpoints.

A `Learner` holds what updates need and nothing rollouts need: its settings, the mesh, the model config and graphdef,
the `TrainState` (replaced by every update: the old one is donated), the shardings of state and batch, the jitted
step and the checkpointer. `update(batch)` places a host `RolloutBatch` (the full global batch, the same on every
process) on the mesh, runs one step and returns its metrics as floats; `policy()` gives the rollouter the current
policy states; `save` / `restore` write and read the state with the rollouter's resumable state as metadata.

Stops and long steps: a stop signal (SIGINT / SIGTERM) is answered at the next step boundary with a checkpoint
(`stop_checkpoint`), but a step still running `checkpoint.stop_grace_s` after the signal is cut (the process exits,
`distributed.StopRequest`), and the state it started from is gone (the step donates it). So every loop's step
boundary (`save(meta)`) after a step that took >= GUARD_FRACTION of the grace is saved as a guard checkpoint: the
async save copies the state to host memory before the next step donates it, the files are written while that step
runs, and the guard is kept only until a newer checkpoint commits (it never displaces the `checkpoint.keep`
interval checkpoints). Steps shorter than that finish within the grace unless the next one is over twice as long;
`checkpoint.every_steps=1` saves every boundary whatever its length.
"""
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
    """True when the step boundary after a step of `step_s` seconds needs a guard checkpoint: a next step as long
    (or up to 1 / GUARD_FRACTION times longer) might not finish, and be saved, within the `grace_s` seconds a stop
    signal leaves (the module docstring)."""
    return step_s >= GUARD_FRACTION * grace_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerSettings:
    """What the update phase needs of a run.

    Attributes:
        workdir: the run's directory (checkpoints/ under it).
        optimizer: the config's optim section.
        total_steps: train steps of the run (the learning-rate schedule's length in steps).
        lora_rank: train adapters only when > 0.
        need_reference: keep the initial policy for a KL term.
        seed: seeds the run's PRNG key.
        checkpointing: the config's checkpoint section (interval, kept count, async writes, stop grace).
        rules: logical-axis rules (`posttrain.infra.mesh.RULES` with the run's overlays; batch sharding).
        config_dict: the run's config as a plain dict, stored with every checkpoint.
        best_metric: keep the checkpoint with the highest value of this metric (given to `save`) beside the
            `checkpoint.keep` newest (the evaluation gate's "eval/gate/score"); None: only the newest.
        updates_per_step: optimizer updates one train step makes (GRPO: rl.ppo_epochs x rl.minibatches); `step`,
            the policy version and the checkpoint numbers count train steps, the state's own counter (the
            learning-rate schedule's clock) counts updates.
    """

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


def batch_shardings(mesh, batch: RolloutBatch | None = None, rules=mesh_lib.RULES,
                    batch_type: type = RolloutBatch) -> RolloutBatch:
    """A batch of NamedShardings: rows / samples split over the mesh's batch shards. Of `batch`'s arrays when
    given; else of every field of `batch_type` (a RolloutBatch or a subclass, e.g. DPO's PairBatch) by its
    dimension suffix (`_RxL`: 2 dims, `_N`: 1), with None (the argument's own placement) for the optional fields
    (default None), so a new field needs no change here."""
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
    """Returns freed heap pages to the OS (glibc `malloc_trim`; a no-op elsewhere). Called before a checkpoint
    save: the train step's freed temporaries otherwise stay resident while orbax allocates its host copies on
    top of them, raising the peak RSS of a CPU run."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclasses.dataclass
class Learner:
    """The update phase of a run (see the module docstring). `nonfinite_run`: consecutive updates skipped for a
    non-finite loss or gradient, up to the last one; `boundary_t`: `time.monotonic()` at the last step boundary
    (`save` without `force`), else at the start of this learner's first update (None before it)."""

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
        """A fresh train state from the loaded model (`graphdef`, `weights`: its nnx state), the settings'
        optimizer and checkpoints, and the algorithm's step: `build_step(graphdef, tx, lr_schedule, model_config)`
        returns the pure step, jitted here by `learn.step.jit_step` with the state's and batch's shardings.
        `read_only`: for commands that only read a run (eval, convert): its checkpointer never writes, renames or
        deletes anything (an unreadable checkpoint is passed over and left in place). `batch_type`: the step's
        batch (RolloutBatch or a subclass with more fields), for the jitted step's input shardings."""
        opt = settings.optimizer.build(settings.total_steps)
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
        """One train step on a host batch; returns its metrics. A skipped (non-finite) update is logged and
        counted in `nonfinite_run`."""
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
        """Restores the newest usable checkpoint (falling back past a corrupt one, which `checkpointer.unreadable`
        lists: moved aside unless read-only) into `state`; returns its metadata (the rollouter's state, the config),
        or None when there is none. Raises CheckpointCorruptError when no complete checkpoint is readable."""
        if self.checkpointer.latest_step() is None:
            return None
        self.state, meta = self.checkpointer.restore(None, self.state)
        return meta

    def save(self, rollout_state: Mapping, *, force: bool = False, metrics: Mapping | None = None) -> None:
        """Saves the state at its step when the checkpoint interval says so (or `force`), with the rollouter's
        state and the config as metadata, and `metrics` (ranked by `settings.best_metric`). A call without `force`
        is a loop's step boundary: after a step (since the last boundary or the first update's start) of at least
        GUARD_FRACTION x `checkpoint.stop_grace_s` seconds (process 0's clock) it saves a guard checkpoint."""
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
        """For a stop signal (SIGINT / SIGTERM) in any training loop: saves the state with `meta` (forced, waited
        for) when the run moved past `start` (nothing to save before its first completed update); returns the
        RunInterrupted to raise, naming the step and the checkpoint the same command resumes from."""
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
    """Training stopped after `train.max_nonfinite_skips` consecutive steps with a non-finite loss or gradient."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The `train` section.

    Attributes:
        steps: updates in the run.
        seed: seeds the init of presets, the task order and the sampling keys.
        workdir: the run's directory (--workdir overrides).
        max_train_seconds: stop after this much training time, in-loop evaluation not counted (0: no limit).
        max_nonfinite_skips: a step whose loss or gradient is NaN/inf is skipped (nothing applied); this many in a
            row stop the run (after saving a checkpoint) with an error.
        machine: the machine the config is written for ("" : not stated), a `posttrain plan` target name:
            "cpu-N:<G>GB" (N CPU devices on a host of G GB; the shipped CPU configs say "cpu-1:24GB", the 2-core
            24 GB machine), "v5p-N", "v5e-N", "v6e-N" or "h200xN" (`runs.preflight.parse_machine` checks it;
            every file in configs/ states one). Informative: the pre-flight check measures the machine running.
        preflight_prompt_len: prompt tokens the pre-flight memory check compiles the train step for (with
            sampling.max_new_tokens per completion) before any model load or write (`runs.preflight`); a run
            whose step's compiled peak exceeds 90% of the memory it has stops there. 0 skips the check.
    """

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
