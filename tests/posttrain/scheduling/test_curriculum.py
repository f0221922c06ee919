"""Difficulty curriculum: levels follow a scripted policy's known pass rate through ReasoningGym-v0; band/step
configurable; learning-progress weights; state restores exactly."""
import json

import numpy as np
import pytest

from envs.tasks import domains
from envs.tasks import reasoning_gym
from posttrain.scheduling.curriculum import CurriculumConfig, DifficultyCurriculum, from_env_specs


class ScriptedPolicy:
    """Replies with the reference answer with probability pass_prob(level), else with a wrong answer."""

    def __init__(self, pass_prob, seed=0):
        self.pass_prob, self.rng, self.envs = pass_prob, np.random.default_rng(seed), {}

    def rewards(self, dataset, level, n, step):
        env = self.envs.get(level) or self.envs.setdefault(level, reasoning_gym.ReasoningGymEnv(
            dataset=dataset, level=level, size=64, num_test=1, self_check=False))
        out = []
        for i in range(n):
            env.reset(seed=step * 1000 + i)
            good = self.rng.random() < self.pass_prob(level)
            answer = env.task["answer"] if good else "wrong"
            out.append(env.step(f"<think>...</think><answer>{answer}</answer>")[1])
        return out


def run(curriculum, policy, steps, n=8, dataset="chain_sum", name="reasoning_gym/chain_sum"):
    levels = []
    for step in range(steps):
        curriculum.update({name: policy.rewards(dataset, curriculum.levels[name], n, step)})
        levels.append(curriculum.levels[name])
    return levels


def make(level=0, **cfg):
    top = reasoning_gym.max_level("chain_sum")
    return DifficultyCurriculum({"reasoning_gym/chain_sum": (level, top)}, {"reasoning_gym/chain_sum": 1.0},
                                CurriculumConfig(**{"window": 8, "min_episodes": 8, **cfg}))


def test_level_rises_while_solved_and_falls_when_not():
    policy = ScriptedPolicy(lambda level: 1.0 if level < 3 else 0.0)  # solves everything below level 3, nothing at 3+
    assert run(make(), policy, 7) == [1, 2, 3, 2, 3, 2, 3]
    easy, hard = (policy.envs[lv].task_source.dataset.config for lv in (0, 3))
    assert easy.max_terms < hard.max_terms  # the library's curriculum made level 3 harder


def test_pass_rate_inside_band_holds_level_and_step_moves_by_step():
    policy = ScriptedPolicy(lambda level: 0.95 if level < 2 else 0.5, seed=1)
    levels = run(make(window=64, min_episodes=32), policy, 20, n=16)
    assert levels[:4] == [0, 1, 1, 2] and set(levels[4:]) == {2}
    assert run(make(step=3), ScriptedPolicy(lambda level: 1.0), 5) == [3, 6, 9, 10, 10]  # capped at the top level
    assert run(make(level=5, step=2, low=0.5, high=0.9), ScriptedPolicy(lambda level: 0.0), 4) == [3, 1, 0, 0]


def test_resume_restores_curriculum_exactly():
    script = ScriptedPolicy(lambda level: [1.0, 0.9, 0.6, 0.3, 0.1][min(level, 4)], seed=3)
    rewards = [script.rewards("chain_sum", 0, 8, s) for s in range(24)]  # fixed reward stream, any level

    def feed(c, batch):
        c.update({"reasoning_gym/chain_sum": [r * (c.levels["reasoning_gym/chain_sum"] < 3) for r in batch]})
        return c.metrics()

    whole, first = make(weighting="learning_progress"), make(weighting="learning_progress")
    trace = [feed(whole, b) for b in rewards]
    for b in rewards[:11]:
        feed(first, b)
    resumed = make(weighting="learning_progress")
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [feed(resumed, b) for b in rewards[11:]] == trace[11:]
    assert resumed.state_dict() == whole.state_dict()
    assert len({m["curriculum/reasoning_gym/chain_sum/level"] for m in trace}) > 1  # it did move


def test_learning_progress_weights_favour_the_changing_domain():
    c = DifficultyCurriculum({"a": (0, 0), "b": (0, 0)}, {"a": 1.0, "b": 2.0},
                             CurriculumConfig(weighting="learning_progress", window=8, min_episodes=8))
    assert c.weights() == {"a": 1.0, "b": 2.0}
    for rate in (0.0, 0.25, 0.5, 0.75):
        c.update({"a": [1.0] * int(8 * rate) + [0.0] * (8 - int(8 * rate)), "b": [1.0, 0.0] * 4})
    w = c.weights()
    assert w["a"] == pytest.approx(1.0 * (0.1 + 1.0))  # the largest progress: base * (lp_floor + 1)
    assert w["b"] == pytest.approx(2.0 * 0.1)  # a flat pass rate has no progress: base * lp_floor
    assert c.metrics()["curriculum/a/weight"] == w["a"]
    fixed = DifficultyCurriculum({"a": (0, 0)}, {"a": 3.0}, CurriculumConfig())
    fixed.update({"a": [1.0, 0.0]})
    assert fixed.weights() == {"a": 3.0}


def test_from_env_specs_reads_levels_and_top_levels():
    specs, _ = domains.select([{"pattern": "reasoning_gym/chain_sum", "level": 2, "weight": 2.0},
                               {"pattern": "reasoning_gym/composite"}])
    specs["arithmetic"] = {"id": "posttrain/Arithmetic-v0", "weight": 1.0, "kwargs": {"digits": 1}}
    c = from_env_specs(specs)
    assert c.levels == {"reasoning_gym/chain_sum": 2, "reasoning_gym/composite": 0, "arithmetic": 0}
    assert c.max_levels == {"reasoning_gym/chain_sum": reasoning_gym.max_level("chain_sum"), "reasoning_gym/composite": 0,
                            "arithmetic": 0}
    assert c.base_weights["reasoning_gym/chain_sum"] == 2.0


@pytest.mark.parametrize("kwargs,match", [
    ({"low": 0.8, "high": 0.8}, r"invalid low/high"),
    ({"step": 0}, r"invalid step"),
    ({"window": 4, "min_episodes": 5}, r"invalid min_episodes"),
    ({"weighting": "bandit"}, r"invalid weighting"),
])
def test_bad_config_raises_one_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CurriculumConfig(**kwargs)


def test_bad_domains_and_state_raise():
    with pytest.raises(ValueError, match=r"start level 4 outside \[0, max level 3\]"):
        DifficultyCurriculum({"a": (4, 3)}, {"a": 1.0})
    c = make()
    with pytest.raises(ValueError, match=r"unknown domain\(s\) \['b'\]"):
        c.update({"b": [1.0]})
    with pytest.raises(ValueError, match=r"checkpoint curriculum is for domains \['b'\]"):
        c.load_state_dict({"domains": {"b": {}}})
