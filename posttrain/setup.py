"""Wiring for a run: mesh, policy, tokenizer, train state, jitted step, checkpoints, tasks and environments.

`build(cfg)` returns a `Run` holding everything the loop needs; nothing here does math. A config is converted
once (`posttrain.config`) and never mutated; the run's workdir gets `config.json` for reference.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax
from flax import nnx

from posttrain import distributed
from posttrain import mesh as mesh_lib
from posttrain import optim, train_step as ts
from posttrain.config import Config, to_dict
from posttrain.precision import PrecisionPolicy, resolve_policy
from posttrain.run_plan import RunPlan, make_run_plan, with_moe
from posttrain.evaluate import eval_episodes
from posttrain.rollout import InlineEnvs
from posttrain.scheduler import TaskScheduler
from posttrain.types import RolloutBatch


@dataclasses.dataclass
class Run:
    cfg: Config
    plan: RunPlan
    model_config: Any
    workdir: pathlib.Path
    mesh: Any
    tokenizer: Any
    graphdef: Any
    state: Any
    train_step: Any
    step_opts: ts.StepOptions
    checkpointer: Any
    scheduler: TaskScheduler
    runner: Any
    train_specs: dict
    eval_episodes: dict
    row_multiple: int
    curriculum: Any = None  # posttrain.curriculum.DifficultyCurriculum when curriculum.enabled

    def policy_state(self):
        """The current policy's nnx states for the sampler (adapters, base, rest under LoRA)."""
        return _policy_state(self.state.params, self.state.frozen, self.step_opts)

    def put_batch(self, batch: RolloutBatch) -> RolloutBatch:
        return jax.tree.map(distributed.global_array, batch, batch_shardings(self.mesh, batch))

    def checkpoint_meta(self) -> dict:
        meta = {"scheduler": self.scheduler.state_dict(), "config": to_dict(self.cfg)}
        if self.curriculum is not None:
            meta["curriculum"] = self.curriculum.state_dict()
        return meta

    def close(self):
        if hasattr(self.runner, "close"):
            self.runner.close()


def _policy_state(params, frozen, opts: ts.StepOptions):
    return ts.model_states(params, frozen)


def batch_shardings(mesh, batch: RolloutBatch) -> RolloutBatch:
    return jax.tree.map(lambda x: mesh_lib.batch_sharding(mesh, x.ndim), batch)


def load_policy(cfg: Config, mesh, policy: PrecisionPolicy | None = None):
    """(ModelConfig, graphdef, state, tokenizer) from the configured source, under the precision policy (default:
    the config's, resolved for this backend)."""
    from posttrain.checkpoints import load_pretrained
    from posttrain.model.presets import get_preset
    from posttrain.model.transformer import Transformer
    from posttrain.partitioning import create_sharded
    from posttrain.tokenizer import Tokenizer

    m = cfg.model
    lora = cfg.lora if cfg.lora.rank else None
    policy = policy or resolve_policy(m.dtype, m.param_dtype, m.matmul_precision)
    fields = dict(dtype=policy.compute_dtype, param_dtype=policy.param_dtype, matmul_precision=policy.matmul_precision,
                  remat=m.remat, remat_names=tuple(m.remat_names), lora=lora)
    if m.preset:
        mcfg = get_preset(m.preset, **fields, **dict(m.overrides))
        tokenizer = Tokenizer.byte_level()
        if mcfg.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"preset {m.preset!r} has vocab_size {mcfg.vocab_size} < {tokenizer.vocab_size} ids of "
                             "the byte tokenizer; set model.overrides.vocab_size")
        graphdef, state = create_sharded(lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.train.seed)), mesh)
        return mcfg, graphdef, state, tokenizer
    pre = load_pretrained(m.path or None, mesh=mesh, **fields)
    if pre.tokenizer is None:
        raise ValueError(f"{m.path}: no tokenizer found next to the weights (tokenizer.json)")
    return pre.config, pre.graphdef, pre.state, pre.tokenizer


def make_runner(cfg: Config):
    if cfg.env.num_workers <= 0:
        return InlineEnvs()
    from envs.pool import EnvPool

    return EnvPool(num_workers=cfg.env.num_workers, step_timeout_s=cfg.env.step_timeout_s)


def task_sources(specs) -> dict:
    """{name: (env_id, kwargs, task_source)}; constructing each env runs its golden self-check (invariant 7)."""
    import gymnasium

    import envs  # noqa: F401

    out = {}
    for name, spec in specs.items():
        env = gymnasium.make(spec.id, **dict(spec.kwargs)).unwrapped
        out[name] = (spec.id, dict(spec.kwargs), env.task_source)
    return out


def apply_levels(curriculum, train_specs: dict, scheduler: TaskScheduler, domains) -> None:
    """Puts each of `domains` at its curriculum level: its env spec gets kwargs["level"] (episodes are built from
    the specs) and the scheduler gets the task source of that level (same tasks, same cursor)."""
    for d in domains:
        spec = train_specs[d]
        train_specs[d] = dataclasses.replace(spec, kwargs={**dict(spec.kwargs), "level": curriculum.levels[d]})
        scheduler.set_source(d, task_sources({d: train_specs[d]})[d][2])


def build(cfg: Config | RunPlan, workdir: str | None = None) -> Run:
    """Builds (or restores) everything a run needs, from its plan (made here from a Config when given one).

    Raises ConfigError (before any I/O) when the config does not make a valid plan."""
    from posttrain.checkpoints.orbax import Checkpointer

    plan = cfg if isinstance(cfg, RunPlan) else make_run_plan(cfg, workdir=workdir)
    cfg, workdir = plan.cfg, plan.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2, default=str))
    mesh = mesh_lib.make_mesh(plan.mesh_shape)
    mcfg, graphdef, model_state, tokenizer = load_policy(cfg, mesh, plan.precision)
    opts = with_moe(plan.step_options, cfg, mcfg.moe)
    o = cfg.optim
    opt = optim.make_optimizer(o.name, lr=o.lr, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
                               grad_clip_norm=o.grad_clip_norm or None, warmup_steps=o.warmup_steps,
                               total_steps=cfg.train.steps, schedule=o.schedule, min_lr_ratio=o.min_lr_ratio)
    with jax.set_mesh(mesh):
        graphdef, state = ts.create_train_state(graphdef, model_state, opt.tx, jax.random.key(cfg.train.seed), opts,
                                                need_reference=cfg.rl.beta > 0)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    step_fn = ts.make_train_step(graphdef, opt.tx, opt.lr_schedule, opts)
    jitted = jax.jit(step_fn, donate_argnums=(0,), out_shardings=(state_sh, None))

    def train_step(st, batch):
        with jax.set_mesh(mesh):
            return jitted(st, batch)

    train = task_sources(cfg.env.train)
    scheduler = TaskScheduler({n: s for n, (_, _, s) in train.items()},
                              {n: cfg.env.train[n].weight for n in train}, seed=cfg.train.seed)
    evals = eval_episodes(task_sources(cfg.env.eval), cfg.eval.num_tasks) if cfg.env.eval else {}
    ckpt = Checkpointer(workdir / "checkpoints", every_steps=cfg.checkpoint.every_steps, keep=cfg.checkpoint.keep,
                        async_save=cfg.checkpoint.async_save)
    train_specs, cur = dict(cfg.env.train), None
    if cfg.curriculum.enabled:
        from posttrain.curriculum import from_env_specs

        cur = from_env_specs(train_specs, cfg.curriculum)
    latest = ckpt.latest_step()
    if latest is not None:
        state, meta = ckpt.restore(None, state)  # newest usable step (falls back past a corrupt one)
        scheduler.load_state_dict(meta["scheduler"])
        if cur is not None:
            cur.load_state_dict(meta["curriculum"])
    if cur is not None:  # every curriculum domain's tasks at its (start or restored) level
        apply_levels(cur, train_specs, scheduler, [d for d in cur.names if cur.max_levels[d] > 0])
        scheduler.set_weights(cur.weights())
    return Run(cfg=cfg, plan=plan, model_config=mcfg, workdir=workdir, mesh=mesh, tokenizer=tokenizer,
               graphdef=graphdef, state=state, train_step=train_step, step_opts=opts, checkpointer=ckpt,
               scheduler=scheduler, runner=make_runner(cfg), train_specs=train_specs, curriculum=cur, eval_episodes=evals,
               row_multiple=plan.row_multiple)
