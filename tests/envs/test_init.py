"""Tests for envs/__init__.py: the gymnasium registry."""
import importlib
import warnings

import gymnasium

import envs


def test_ids_are_registered_idempotently():
    """Re-importing the package and registering again leave every registered spec in place: gymnasium only warns
    ("Overriding environment ...") on a double registration, so the test records warnings and compares specs."""
    before = {env_id: gymnasium.registry[env_id] for env_id in envs.ENTRY_POINTS}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.reload(envs)
        envs.register_all()
    overridden = [str(w.message) for w in caught if "already in registry" in str(w.message)]
    assert not overridden, overridden
    assert {env_id: gymnasium.registry[env_id] for env_id in envs.ENTRY_POINTS} == before
    assert all(gymnasium.registry[env_id] is spec for env_id, spec in before.items())


def test_a_double_registration_is_what_the_idempotence_test_catches():
    """The check above can fail: registering an id again warns and replaces its spec."""
    env_id = "posttrain/Arithmetic-v0"
    spec = gymnasium.registry[env_id]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gymnasium.register(env_id, entry_point=envs.ENTRY_POINTS[env_id])
        assert any("already in registry" in str(w.message) for w in caught)
        assert gymnasium.registry[env_id] is not spec
    finally:
        gymnasium.registry[env_id] = spec


def test_make_by_id_runs_an_episode():
    env = gymnasium.make("posttrain/Arithmetic-v0", split="test")
    obs, info = env.reset(seed=0)
    a, b = env.unwrapped.task["operands"]
    _, reward, terminated, truncated, info = env.step(f"{a} + {b} = {a + b}")
    assert reward == 1.0 and terminated and not truncated and info["status"] == "ok"
