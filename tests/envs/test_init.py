"""Tests for envs/__init__.py: the gymnasium registry."""
import importlib

import gymnasium

import envs


def test_ids_are_registered_idempotently():
    for env_id in envs.ENTRY_POINTS:
        assert env_id in gymnasium.registry
    importlib.reload(envs)
    envs.register_all()
    assert all(env_id in gymnasium.registry for env_id in envs.ENTRY_POINTS)


def test_make_by_id_runs_an_episode():
    env = gymnasium.make("posttrain/Arithmetic-v0", split="test")
    obs, info = env.reset(seed=0)
    a, b = env.unwrapped.task["operands"]
    _, reward, terminated, truncated, info = env.step(f"{a} + {b} = {a + b}")
    assert reward == 1.0 and terminated and not truncated and info["status"] == "ok"
