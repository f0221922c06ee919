"""configs/reasoning_mix.py and configs/reasoning_tiny.py: registry-selected reasoning-gym domains that build,
self-check and (tiny) fit the tiny model's context."""
import importlib.util
import pathlib

import gymnasium
import pytest

import envs  # noqa: F401
from posttrain.config import from_config_dict
from posttrain.model.presets import get_preset
from posttrain.model.tokenizer import Tokenizer

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "configs"


def load(stem):
    spec = importlib.util.spec_from_file_location(stem, CONFIGS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return from_config_dict(module.get_config())


def test_reasoning_mix_has_at_least_five_easy_verified_unflagged_domains():
    cfg = load("reasoning_mix")  # of its ten candidates, four pay >= 0.2 for a constant answer (the floor table)
    assert len(cfg.env.train) >= 5 and set(cfg.env.train) == set(cfg.env.eval)
    assert all(name.startswith("reasoning_gym/") for name in cfg.env.train)
    assert all(s.kwargs.get("level") is None and s.kwargs["config"] != "{}" for s in cfg.env.train.values())
    assert {s.kwargs["split"] for s in cfg.env.eval.values()} == {"test"}
    assert cfg.model.preset in ("", None) and cfg.sampling.max_new_tokens >= 48


@pytest.mark.parametrize("split", ["train", "eval"])
def test_reasoning_tiny_envs_build_and_prompts_fit_the_tiny_model(split):
    cfg = load("reasoning_tiny")
    specs = getattr(cfg.env, split)
    assert set(specs) == {"reasoning_gym/chain_sum", "reasoning_gym/basic_arithmetic", "reasoning_gym/spell_backward"}
    assert specs["reasoning_gym/chain_sum"].weight == 2.0
    tok = Tokenizer.byte_level()
    max_position = get_preset(cfg.model.preset, **dict(cfg.model.overrides)).max_position
    for spec in specs.values():
        env = gymnasium.make(spec.id, **dict(spec.kwargs)).unwrapped  # runs the golden self-check
        for i in range(env.task_source.num_tasks):
            obs, _ = env.reset(options={"task": env.task_source.get_task(i)})
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": obs}], add_generation_prompt=True))
            assert len(ids) + cfg.sampling.max_new_tokens <= max_position, (spec.kwargs["dataset"], len(ids))


def test_the_mix_gate_suite_has_100_tasks_per_candidate_and_marks_the_trained_domains():
    from posttrain.eval import suite as suite_lib
    cfg = load("reasoning_mix")
    suite = suite_lib.load_suite(CONFIGS / "eval" / "reasoning_mix.py")
    by_name = {d.name: d for d in suite.domains}
    assert len(by_name) == 10 and {d.tasks for d in suite.domains} == {100}  # issue 22: >= 100 held-out per domain
    assert {n for n, d in by_name.items() if d.trained} == set(cfg.env.train)  # what the mix trains on, no more
    assert {d.max_new_tokens for d in suite.domains} == {cfg.eval.max_new_tokens}
