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

from posttrain import distributed, losses as losses_lib
from posttrain import mesh as mesh_lib
from posttrain import optim, train_step as ts
from posttrain.config import Config, to_dict
from posttrain.precision import resolve_policy
from posttrain.evaluate import eval_episodes
from posttrain.rollout import InlineEnvs
from posttrain.scheduler import TaskScheduler
from posttrain.types import RolloutBatch


@dataclasses.dataclass
class Run:
    cfg: Config
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

    def policy_state(self):
        """The current policy's nnx states for the sampler (adapters, base, rest under LoRA)."""
        return _policy_state(self.state.params, self.state.frozen, self.step_opts)

    def put_batch(self, batch: RolloutBatch) -> RolloutBatch:
        return jax.tree.map(distributed.global_array, batch, batch_shardings(self.mesh, batch))

    def checkpoint_meta(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "config": to_dict(self.cfg)}

    def close(self):
        if hasattr(self.runner, "close"):
            self.runner.close()


def _policy_state(params, frozen, opts: ts.StepOptions):
    return ts.model_states(params, frozen)


def batch_shardings(mesh, batch: RolloutBatch) -> RolloutBatch:
    return jax.tree.map(lambda x: mesh_lib.batch_sharding(mesh, x.ndim), batch)


def load_policy(cfg: Config, mesh):
    """(ModelConfig, graphdef, state, tokenizer) from the configured source."""
    from posttrain.checkpoints import load_pretrained
    from posttrain.model.presets import get_preset
    from posttrain.model.transformer import Transformer
    from posttrain.partitioning import create_sharded
    from posttrain.tokenizer import Tokenizer

    m = cfg.model
    lora = cfg.lora if cfg.lora.rank else None
    policy = resolve_policy(m.dtype, m.param_dtype, m.matmul_precision)
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


def step_options(cfg: Config, mcfg) -> ts.StepOptions:
    rl = cfg.rl
    loss = losses_lib.LossConfig(
        policy_loss=rl.loss, eps_low=rl.eps_low, eps_high=rl.eps_high, dual_clip_c=rl.dual_clip_c or None,
        kl_estimator=rl.kl_estimator, beta=rl.beta, aggregation=rl.aggregation,
        norm_constant=(rl.norm_constant or float(cfg.sampling.max_new_tokens)), tis_cap=rl.tis_cap or None)
    moe = mcfg.moe
    aux = (rl.moe_aux_coef if rl.moe_aux_coef >= 0 else moe.aux_loss_coef) if moe else 0.0
    return ts.StepOptions(loss=loss, temperature=cfg.sampling.temperature or 1.0, num_microbatches=rl.num_microbatches,
                          moe_aux_coef=aux, moe_z_coef=moe.z_loss_coef if moe else 0.0,
                          bias_update_rate=moe.bias_update_rate if moe and moe.score_bias else 0.0,
                          lora_rank=cfg.lora.rank, ppo_epochs=rl.ppo_epochs, minibatches=rl.minibatches,
                          matmul_precision=cfg.model.matmul_precision)


def build(cfg: Config, workdir: str | None = None) -> Run:
    """Builds (or restores) everything a run needs."""
    from posttrain.checkpoints.orbax import Checkpointer

    workdir = pathlib.Path(workdir or cfg.train.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2, default=str))
    mesh = mesh_lib.make_mesh(dataclasses.asdict(cfg.mesh))
    mcfg, graphdef, model_state, tokenizer = load_policy(cfg, mesh)
    opts = step_options(cfg, mcfg)
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
    latest = ckpt.latest_step()
    if latest is not None:
        state, meta = ckpt.restore(None, state)  # newest usable step (falls back past a corrupt one)
        scheduler.load_state_dict(meta["scheduler"])
    shards = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    return Run(cfg=cfg, workdir=workdir, mesh=mesh, tokenizer=tokenizer, graphdef=graphdef, state=state,
               train_step=train_step, step_opts=opts, checkpointer=ckpt, scheduler=scheduler, runner=make_runner(cfg),
               train_specs=dict(cfg.env.train), eval_episodes=evals,
               row_multiple=cfg.rl.minibatches * cfg.rl.num_microbatches * shards)
