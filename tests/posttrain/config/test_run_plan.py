"""The run plan: bad configs stop with one line and exit 2 before any model load or worker start; the logprob
temperature and the batch shard count each come from one function."""
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.learn.logprobs import score_logprobs
from posttrain import cli

from posttrain.recipes import grpo
from posttrain.config import load as config_load, plan as run_plan

from posttrain.rollout import rollouter

from posttrain.checkpoints import policy
from posttrain.infra import mesh as mesh_lib
from posttrain.algos.grpo import step
from posttrain.config import ConfigError, default_config, env_spec, from_config_dict
from helpers import saved_run
from posttrain.generate.sampler import logprob_temperature, pad_prompts, sample

TINY = "configs/tiny.py"
BAD = [  # (override, what the one line must name)
    ("--config.rl.eps_low=1.5", "rl.eps_low=1.5"),
    ("--config.sampling.temperature=-1", "sampling.temperature=-1"),
    ("--config.sampling.top_p=0", "sampling.top_p=0"),
    ("--config.rl.tis_cap=-2", "rl.tis_cap=-2"),
    ("--config.rl.group_sizee=3", "group_sizee"),
    ("--config.optim.lrr=0.1", "lrr"),
    ("--config.rl.group_size=two", "group_size"),
    ("--config.mesh.data=3", "mesh"),
    ("--config.rl.minibatches=3", "rl.minibatches=3"),
    ("--config.rl.routing_replay=on", "rl.routing_replay='on'"),
    ("--config.model.preset=", "model.path"),  # with the next override: a missing model file
    # kind: every config value, env id, env kwarg, model path and preset is checked before any
    # model load or worker start (each env built once, in the plan's dry check), in one line naming key and value
    ("--config.model.preset=nope", "model.preset='nope' is unknown; presets: ["),
    ("--config.model.overrides.vocab_size=100", "vocab_size 100 < the 259 ids of the byte tokenizer"),
    ("--config.model.overrides.vocab_siz=320", 'Did you mean "vocab_size"'),
    ("--config.model.overrides.d_model=32", "model.overrides is a dict without the key 'd_model'"),
    ("--config.model.preset= --config.model.path=README.md", "README.md is not a GGUF file"),
    ("--config.model.preset= --config.model.path={run}", "is a posttrain run directory, not a model"),
    ("--config.model.preset= --config.model.path={hf_gpt2}", "model_type='gpt2' is not supported; supported: ("),
    ("--config.model.preset= --config.model.path={hf_llama}", "apply to a model.preset only"),
    ("--config.env.train.arithmetic.id=posttrain/Nope-v0", "env.train.arithmetic: id='posttrain/Nope-v0'"),
    ("--config.env.train.arithmetic.id=Nope-v0", "an env of your own: 'my.module:MyEnv-v0'"),
    ("--config.env.train.arithmetic.id=nomod:Nope-v0", "No module named 'nomod'"),
    ("--config.env.train.arithmetic.kwargs.digits=0", "digits must be an int >= 1, got 0"),
    ("--config.env.train.arithmetic.kwargs.digts=1", 'Did you mean "digits"'),
    ("--config.env.eval.arithmetic.kwargs.split=nope", "env.eval.arithmetic: id='posttrain/Arithmetic-v0'"),
    ("--config.env.train.arithmetic.weight=0", "env.train.arithmetic.weight=0.0 is out of range: must be > 0"),
    ("--config.env.train.arith.id=x", "env.train is a dict without the key 'arith'"),
    ("--config.lora.rank=4 --config.lora.targets=('q_prj',)", "['q_prj'] are not projection names"),
    ("--config.train.seed=-1", "train.seed=-1 is out of range"),
    ("--config.rl.nope=1", "rl has no key 'nope'; its keys: ["),
    # kind: a setting that cannot learn is refused with the reason
    ("--config.rl.group_size=1", "rl.group_size=1 is out of range: must be >= 2 (a group of 1 is its own baseline"),
    ("--config.rl.group_size=0", "rl.group_size=0 is out of range: must be >= 2"),
]


def _fake_model_dirs(root):
    """{run}: a posttrain run directory; {hf_gpt2}: an HF directory of an unsupported architecture; {hf_llama}: a
    supported one (its weights are never read)."""
    import json

    dirs = {"run": root / "run", "hf_gpt2": root / "gpt2", "hf_llama": root / "llama"}
    (dirs["run"] / "checkpoints").mkdir(parents=True)
    for name, model_type in (("hf_gpt2", "gpt2"), ("hf_llama", "llama")):
        dirs[name].mkdir()
        (dirs[name] / "config.json").write_text(json.dumps({"model_type": model_type}))
    return dirs


@pytest.mark.parametrize("override,named", BAD, ids=[b[0].split("=")[0].removeprefix("--config.") for b in BAD])
def test_bad_config_exits_2_with_one_line_before_any_work(override, named, monkeypatch, capsys, tmp_path,
                                                          tmp_path_factory):
    def forbidden(*a, **k):
        raise AssertionError("a bad config reached model loading / worker start")

    monkeypatch.setattr(policy, "load_policy", forbidden)
    monkeypatch.setattr(grpo, "load_policy", forbidden)
    monkeypatch.setattr(rollouter, "env_runner", forbidden)
    dirs = _fake_model_dirs(tmp_path_factory.mktemp("models"))
    argv = ["posttrain", "train", f"--config={TINY}", *override.format(**dirs).split(" "), f"--workdir={tmp_path}"]
    if override == "--config.model.preset=":
        argv.append("--config.model.path=/nonexistent/model.gguf")
    monkeypatch.setattr(sys, "argv", list(argv))  # ml_collections reads --config.* overrides from sys.argv
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert named in err, err
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("command,listed,absent", [
    ("train", ["--config=", "--workdir=", "--progress=", "--config.<section>.<key>"], ["--checkpoint=", "--prompt="]),
    ("eval", ["--config=", "--checkpoint="], ["--progress=", "--prompt="]),
    ("sample", ["--prompt=", "--model=", "--temperature=", "--checkpoint=", "--seed="],
     ["--progress=", "--config.<section>"]),
    ("convert", ["--out=", "--dtype=", "--peft_out=", "--checkpoint="], ["--progress="]),
    ("plan", ["--target=", "--json="], ["--checkpoint="]),
])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_flags_of_each_command(command, listed, absent, flag, capsys):
    """`posttrain <command> --help` (or -h) prints the command's usage and its flags, exit code 0."""
    assert cli.main(["posttrain", command, flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: posttrain {command}") and f"posttrain {command} " in out.splitlines()[1]
    assert all(x in out for x in listed) and not any(x in out for x in absent), out


def test_every_env_is_built_once_before_the_model_loads(tmp_path, monkeypatch):
    """The plan's dry check builds each env of env.train and env.eval once; the rollouter reuses what it built."""
    import gymnasium

    from helpers import tiny_config

    events, make = [], gymnasium.make
    monkeypatch.setattr(gymnasium, "make", lambda env_id, **kw: events.append(("make", env_id)) or make(env_id, **kw))

    def load(*a, **k):
        events.append(("load_policy",))
        raise RuntimeError("stop here")

    monkeypatch.setattr(grpo, "load_policy", load)
    with pytest.raises(RuntimeError, match="stop here"):
        grpo.build(run_plan.make_run_plan(tiny_config(tmp_path / "run")))
    assert events == [("make", "posttrain/Arithmetic-v0")] * 2 + [("load_policy",)]


def test_library_api_raises_value_error():
    c = default_config()
    c.env.train = {"a": env_spec("posttrain/Arithmetic-v0")}
    c.rl.eps_low = 1.5
    with pytest.raises(ValueError, match=r"rl\.eps_low=1\.5"):
        from_config_dict(c)
    c.rl.eps_low, c.mesh.data = 0.2, 3
    with pytest.raises(ConfigError, match="does not fit 2 device"):
        run_plan.make_run_plan(from_config_dict(c), num_devices=2)


def _tiny_cfg(**over):
    c = default_config()
    c.model.preset, c.model.overrides = "tiny-dense", {"vocab_size": 320}  # the byte tokenizer's ids fit
    c.env.train = {"a": env_spec("posttrain/Arithmetic-v0", digits=1)}
    for k, v in over.items():
        section, key = k.split(".")
        setattr(getattr(c, section), key, v)
    return from_config_dict(c)


def test_batch_shards_follow_the_batch_rule():
    assert mesh_lib.batch_shards({"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}) == 4
    assert mesh_lib.batch_shards({"data": 1, "fsdp": 2, "tensor": 1, "expert": 4}) == 8  # expert splits the batch
    plan = run_plan.make_run_plan(_tiny_cfg(**{"mesh.tensor": 2, "rl.num_microbatches": 2}), num_devices=8)
    assert plan.mesh_shape == {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
    assert plan.batch_shards == 4 and plan.row_multiple == 2 * 4


def test_sampler_and_trainer_use_the_same_logprob_temperature():
    """For T in {0, 0.6, 1}, the sampler's recorded logprobs equal the trainer's at the plan's temperature
    (greedy: T = 1), and a different T is visible."""
    from posttrain.rollout import batching
    from posttrain.model.presets import get_preset
    from posttrain.model.transformer import Transformer
    from posttrain.rollout.episodes import Sample

    graphdef, state = nnx.split(Transformer(get_preset("tiny-dense"), rngs=nnx.Rngs(0)))
    score = jax.jit(lambda b, t: score_logprobs(nnx.merge(graphdef, state), b, t, 64)[0].logp_BxT,
                    static_argnums=1)
    prompt_ids = [[1, 2, 3, 4], [5, 6, 7]]
    prompts, lengths = pad_prompts(prompt_ids, 0)
    for temperature in (0.0, 0.6, 1.0):
        plan = run_plan.make_run_plan(_tiny_cfg(**{"sampling.temperature": temperature, "sampling.max_new_tokens": 5}))
        assert plan.step.temperature == logprob_temperature(temperature) == (temperature or 1.0)
        out = sample(graphdef, state, prompts, lengths, jax.random.key(1), group_size=2, params=plan.config.sampling.params(),
                     stop_ids=(), pad_id=0)
        samples = [Sample(domain="d", group=n // 2, prompt_ids=prompt_ids[n // 2], status="ok",
                          segments=[(np.asarray(out.tokens_NxLg[n]), np.asarray(out.logp_NxLg[n]), True)])
                   for n in range(4)]
        batch = jax.tree.map(jnp.asarray, batching.assemble(samples, advantage_fn("grpo"), group_size=2)[0])
        mask, recorded = np.asarray(batch.loss_mask_NxC), np.asarray(batch.logp_sample_NxC)
        trainer = np.asarray(score(batch, plan.step.temperature))
        np.testing.assert_allclose(trainer[mask], recorded[mask], atol=2e-5, err_msg=f"T={temperature}")
        assert np.abs(np.asarray(score(batch, 0.3))[mask] - recorded[mask]).max() > 1e-2


def test_plan_is_frozen():
    plan = run_plan.make_run_plan(_tiny_cfg())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.row_multiple = 3


def _rules_cfg(**rules):
    c = default_config()
    c.model.preset, c.model.overrides = "tiny-dense", {"vocab_size": 320}
    c.env.train = {"a": env_spec("posttrain/Arithmetic-v0")}
    c.mesh.rules = rules
    return c


@pytest.mark.parametrize("rules,error", [({"embedd": None}, "unknown logical axis 'embedd'"),
                                         ({"embed": "fsdpp"}, "mesh axes are")])
def test_mesh_rules_with_unknown_names_are_config_errors(rules, error):
    with pytest.raises(ConfigError, match=error):
        from_config_dict(_rules_cfg(**rules))


def test_mesh_rules_overlay_the_parameter_and_batch_shardings():
    # the same overlay reaches the batch shard count (run plan) and the parameters' placement (load_policy)
    cfgs = {name: from_config_dict(_rules_cfg(**rules))
            for name, rules in (("default", {}), ("no_fsdp", {"embed": None}), ("data_batch", {"batch": ["data"]}))}
    plans = {name: run_plan.make_run_plan(cfg, num_devices=8) for name, cfg in cfgs.items()}
    assert [plans[n].batch_shards for n in plans] == [8, 8, 1]
    assert dict(plans["no_fsdp"].rules)["embed"] is None and dict(plans["default"].rules)["embed"] == "fsdp"
    specs = {}
    for name in ("default", "no_fsdp"):
        plan = run_plan.make_run_plan(cfgs[name])  # this process's one device
        mesh = mesh_lib.make_mesh(plan.mesh_shape)
        _, _, state, _ = policy.load_policy(plan.policy, mesh, plan.rules)
        specs[name] = tuple(state["embedding"].value.sharding.spec)
    assert specs == {"default": ("tensor", "fsdp"), "no_fsdp": ("tensor", None)}


def test_moe_run_settings_reach_the_moe_layers():
    from posttrain.model.transformer import Transformer  # noqa: F401  (graphdef merge)

    c = _rules_cfg()
    c.model.preset = "tiny-moe"
    c.model.moe_gmm_impl, c.model.moe_capacity_factor, c.model.moe_ep_capacity_factor = "ragged", 1.5, 3.0
    c.model.attention_impl, c.model.grad_dtype = "pallas_gpu", "compute"
    plan = run_plan.make_run_plan(from_config_dict(c))
    mcfg, graphdef, state, _ = policy.load_policy(plan.policy, mesh_lib.make_mesh(plan.mesh_shape),
                                                 plan.rules)
    model = nnx.merge(graphdef, state)
    ffn = model.moe_layers.ffn
    assert (ffn.gmm_impl, ffn.capacity_factor, ffn.ep_capacity_factor) == ("ragged", 1.5, 3.0)
    assert mcfg.attention_impl == "pallas_gpu" and model.moe_layers.attn.attention_impl == "pallas_gpu"
    assert mcfg.grad_dtype == model.grad_dtype == "compute"
    c.model.attention_impl = "flash"
    with pytest.raises(ConfigError, match="model.attention_impl"):
        from_config_dict(c)
    c.model.attention_impl = "auto"
    c.model.moe_gmm_impl = "capacity"  # chosen by moe_capacity_factor, not by name
    with pytest.raises(ConfigError, match="model.moe_gmm_impl"):
        from_config_dict(c)


def _registries():
    from posttrain.algos.grpo import losses
    from posttrain.algos.grpo.advantages import ADVANTAGES
    from posttrain.eval.runner import SCORERS
    from posttrain.learn.optim import OPTIMIZERS, SCHEDULES

    return {("rl", "advantage"): ADVANTAGES, ("rl", "loss"): losses.POLICY_LOSSES,
            ("rl", "kl_estimator"): losses.KL_ESTIMATORS, ("rl", "aggregation"): losses.AGGREGATIONS,
            ("optim", "name"): OPTIMIZERS, ("optim", "schedule"): SCHEDULES, ("eval", "scorer"): SCORERS}


@pytest.mark.parametrize("section,key", sorted(_registries()))
def test_registry_names_are_checked_against_the_registries(section, key):
    """Each name a section checks is allowed exactly when it is a key of its registry (no second list)."""
    registry = _registries()[(section, key)]
    for name in registry:  # every registered name makes a plan
        run_plan.make_run_plan(_tiny_cfg(**{f"{section}.{key}": name}))
    with pytest.raises(ConfigError, match=rf"{section}.{key}='nope'; expected one of"):
        run_plan.make_run_plan(_tiny_cfg(**{f"{section}.{key}": "nope"}))


# kind: each policy loss brings its paper's settings unless the config sets them
@pytest.mark.parametrize("loss,over,want", [
    ("ppo", {}, (0.2, 0.2, "token_mean")),
    ("gspo", {}, (3e-4, 4e-4, "seq_mean_token_mean")),  # GSPO's sequence-ratio clip range and sequence mean
    ("gspo", {"rl.eps_high": 1e-3}, (3e-4, 1e-3, "seq_mean_token_mean")),
    ("gspo", {"rl.aggregation": "token_mean"}, (3e-4, 4e-4, "token_mean")),
    ("ppo", {"rl.eps_low": 0.1, "rl.eps_high": 0.28}, (0.1, 0.28, "token_mean")),  # DAPO's clip-higher
    ("ppo", {"rl.eps_low": 0.2, "rl.aggregation": "seq_mean_token_mean"}, (0.2, 0.2, "seq_mean_token_mean")),
])
def test_each_loss_brings_its_own_defaults_unless_overridden(loss, over, want):
    plan = run_plan.make_run_plan(_tiny_cfg(**{"rl.loss": loss, **over}))
    got = plan.step.loss
    assert (got.eps_low, got.eps_high, got.aggregation) == want
    rl = plan.config_dict["rl"]  # what config.json and the checkpoints record: the values used
    assert (rl["eps_low"], rl["eps_high"], rl["aggregation"]) == want


def test_every_policy_loss_has_defaults_and_gspo_no_longer_trains_like_ppo():
    """With their defaults the GSPO and PPO gradients differ (they were equal: GSPO ran with PPO's settings)."""
    from posttrain.algos.grpo import losses

    assert set(losses.LOSS_DEFAULTS) == set(losses.POLICY_LOSSES)
    rng = np.random.default_rng(0)
    logp = jnp.asarray(-rng.random((4, 6)), jnp.float32)
    old = logp + jnp.asarray(0.05 * rng.standard_normal((4, 6)), jnp.float32)  # ratios off 1 (a later epoch)
    mask, adv = jnp.asarray(rng.random((4, 6)) > 0.2), jnp.asarray([1.0, -1.0, 0.5, -0.5])
    grads = {}
    for name in ("ppo", "gspo"):
        cfg = run_plan.make_run_plan(_tiny_cfg(**{"rl.loss": name})).step.loss
        fn = lambda lp: losses.policy_loss(lp, old, adv, mask, losses.loss_denominators(mask), cfg,  # noqa: E731
                                           logp_old_BxT=old)[0]
        grads[name] = np.asarray(jax.grad(fn)(logp))
    assert not np.allclose(grads["ppo"], grads["gspo"], atol=1e-4)


@pytest.mark.parametrize("temperature,top_k,warned", [(1.0, 0, False), (0.7, 50, False), (0.0, 0, True),
                                                      (1.0, 1, True), (0.0, 1, True)])
def test_greedy_training_rollouts_are_warned_about(temperature, top_k, warned):
    plan = run_plan.make_run_plan(_tiny_cfg(**{"sampling.temperature": temperature, "sampling.top_k": top_k}))
    greedy = [w for w in plan.warnings if "greedy" in w]
    assert len(greedy) == int(warned)
    if warned:
        assert "every advantage (and the policy gradient) is zero" in greedy[0]


# kind: a run's saved config is the source of truth: resuming with other settings refuses (or, allowed, is recorded)
@pytest.mark.parametrize("over,changed", [
    ({}, {}),
    ({"train.steps": 9}, {"train.steps": [3, 9]}),  # extending a run: never refused, recorded
    ({"optim.lr": 2e-5, "rl.group_size": 2, "checkpoint.every_steps": 5},
     {"checkpoint.every_steps": [2, 5], "optim.lr": [1e-3, 2e-5], "rl.group_size": [4, 2]}),
    ({"lora.rank": 8}, {"lora.rank": [0, 8]}),
])
@pytest.mark.parametrize("allow", [False, True])
def test_resuming_with_changed_settings_refuses_unless_allowed(tmp_path, over, changed, allow):
    from helpers import tiny_config

    from posttrain.runs.workdir import RESUME_FREE_KEYS

    saved_run(tmp_path)
    plan = run_plan.make_run_plan(tiny_config(tmp_path, **over))
    refused = {k: v for k, v in changed.items() if k not in RESUME_FREE_KEYS}
    if refused and not allow:
        with pytest.raises(ConfigError) as info:
            grpo.resume_changes(plan)
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        assert str(info.value).startswith(f"resuming {tmp_path} (checkpoint 2) with changed settings: {listed}; ")
        assert ("--allow_config_change on the command line, allow_config_change=True in grpo.train(...)"
                in str(info.value))
    else:
        assert grpo.resume_changes(plan, allow) == {k: [*v, 2] for k, v in changed.items()}


def test_changes_count_only_when_a_checkpoint_will_be_restored(tmp_path):
    from helpers import tiny_config

    saved_run(tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "checkpoints")  # killed before its first checkpoint: the rerun starts over
    assert grpo.resume_changes(run_plan.make_run_plan(tiny_config(tmp_path, **{"optim.lr": 0.5}))) == {}


@pytest.mark.parametrize("given,lora_rank,warned", [(None, 8, False), ({}, 8, True), ({"lora.rank": 8}, 8, False)])
def test_commands_reading_a_run_use_its_saved_model_and_lora(tmp_path, given, lora_rank, warned, caplog):
    """eval / convert: --checkpoint alone is the run's own config; a --config keeps its other sections but takes the
    run's model and lora (a forgotten --config.lora.rank=8 used to end in a 30-line CheckpointStructureError)."""
    from helpers import tiny_config

    saved_run(tmp_path, **{"lora.rank": 8, "optim.lr": 0.5})
    cfg = None if given is None else tiny_config(tmp_path / "other", **{"eval.num_tasks": 7, **given})
    got = config_load.config_for_run(tmp_path, cfg)
    assert got.lora.rank == lora_rank and got.model.overrides == {"vocab_size": 320}
    assert (got.optim.lr, got.eval.num_tasks) == ((0.5, 20) if given is None else (1e-3, 7))
    assert any("using the run's own lora.rank=8 (not 0)" in r.getMessage() for r in caplog.records) == warned
    with pytest.raises(ConfigError, match=r"no config.json in it \(not a run's directory\?\); pass the run's --config"):
        config_load.config_for_run(tmp_path / "empty")


@pytest.mark.parametrize("command", ["train", "eval"])
def test_the_cli_reads_a_run_by_its_directory_alone(tmp_path, monkeypatch, command):
    """`posttrain train --workdir=DIR` resumes with the saved settings; `posttrain eval --checkpoint=DIR` evaluates
    with them (both needed --config, and config.json could not be passed back)."""
    saved = saved_run(tmp_path / "run", **{"optim.lr": 0.5, "lora.rank": 4})
    seen = []
    monkeypatch.setattr(grpo, "train", lambda plan, **k: seen.append(plan) or {})
    monkeypatch.setattr(grpo, "evaluate_run", lambda plan: seen.append(plan) or (2, {}))
    monkeypatch.setenv("POSTTRAIN_XLA_CACHE", "0")
    flag = "--workdir" if command == "train" else "--checkpoint"
    argv = ["posttrain", command, f"{flag}={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", list(argv))
    assert cli.main(argv) == 0
    assert seen[0].config_dict == saved.config_dict


def test_a_failed_restore_leaves_the_saved_settings_as_they_were(tmp_path):
    """--allow_config_change into a run whose checkpoint cannot be restored (here a state of another shape): the
    restore fails, and config.json and config_changes.jsonl stay as they were, so the run can still be resumed
    with its own settings (they were rewritten before the restore, which left the run stuck)."""
    from helpers import saved_run, tiny_config

    from posttrain.checkpoints.orbax import CheckpointStructureError

    saved_run(tmp_path)
    before = (tmp_path / "config.json").read_text()
    with pytest.raises(CheckpointStructureError):
        grpo.train(run_plan.make_run_plan(tiny_config(tmp_path, **{"optim.lr": 0.5})), progress=False,
                   allow_config_change=True)
    assert (tmp_path / "config.json").read_text() == before and not (tmp_path / "config_changes.jsonl").exists()
