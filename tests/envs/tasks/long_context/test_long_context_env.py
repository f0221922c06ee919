"""The long-context environments: registered ids, kwargs, scoring through gymnasium, a tokenizer.json counter, the
registry's floors and golden samples."""
import gymnasium
import pytest

import envs  # noqa: F401  (registers the ids)
from envs.tasks import probes
from envs.tasks.long_context import env as lc_env
from envs.tasks.long_context import lengths

IDS = {"posttrain/DocAnalysis-v0": lc_env.DocAnalysisEnv, "posttrain/LongSynthetic-v0": lc_env.LongSyntheticEnv,
       "posttrain/CodebaseQA-v0": lc_env.CodebaseQAEnv}


@pytest.mark.parametrize("env_id", IDS)
def test_an_episode_through_gymnasium(env_id):
    env = gymnasium.make(env_id, split="test", target_tokens=2048, depth=0.25, num_test=5)
    obs, info = env.reset(seed=0)
    task = env.unwrapped.task
    assert obs == task["prompt"] and info["split"] == "test" and task["depth"] == 0.25
    assert task["type"] in IDS[env_id].all_types
    _, reward, terminated, truncated, info = env.step(f"Thinking...\n<answer>{task['answer']}</answer>")
    assert (reward, terminated, truncated, info["status"]) == (1.0, True, False, "ok")
    env.reset(options={"task": task})
    _, reward, *_ = env.step("<answer>no idea</answer>")
    assert reward == 0.0
    assert env.unwrapped.task_source.num_tasks == 5


def test_types_kwarg_selects_question_types():
    env = lc_env.DocAnalysisEnv(target_tokens=1024, types=["consistency"])
    assert {env.task_source.get_task(i)["type"] for i in range(4)} == {"consistency"}
    with pytest.raises(ValueError, match="unknown types"):
        lc_env.DocAnalysisEnv(types=["summary"])


@pytest.mark.parametrize("kwargs", [{"split": "dev"}, {"target_tokens": 10}, {"depth": 2.0}, {"num_tasks": 0},
                                    {"num_test": -1}])
def test_bad_kwargs_raise(kwargs):
    with pytest.raises(ValueError):
        lc_env.LongSyntheticEnv(**kwargs)


def test_a_missing_tokenizer_file_raises():
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        lc_env.CodebaseQAEnv(tokenizer="/no/such/tokenizer.json")


def test_a_tokenizer_json_counts_the_target(tmp_path, smollm2_tokenizer, smollm2_count):
    path = tmp_path / "tokenizer.json"
    smollm2_tokenizer.backend.save(str(path))
    source = lc_env.DocAnalysisEnv(split="test", target_tokens=4096, tokenizer=str(path)).task_source
    for i in range(5):
        assert abs(smollm2_count(source.get_task(i)["prompt"]) - 4096) <= 0.05 * 4096


def test_prompts_longer_than_a_million_characters_pass_the_env_checker():
    env = gymnasium.make("posttrain/LongSynthetic-v0", target_tokens=300_000, num_test=1, split="test")
    obs, _ = env.reset(seed=0)
    assert len(obs) > 1 << 20 and env.observation_space.contains(obs)


def test_the_same_index_gives_the_same_task_and_splits_differ():
    a = lc_env.DocAnalysisEnv(split="train", target_tokens=1024, seed=3).task_source
    b = lc_env.DocAnalysisEnv(split="train", target_tokens=1024, seed=3).task_source
    test = lc_env.DocAnalysisEnv(split="test", target_tokens=1024, seed=3).task_source
    assert a.get_task(7) == b.get_task(7) and a.get_task(7)["seed"] < lengths.TEST_SEED_BASE
    assert test.get_task(7)["seed"] == lengths.TEST_SEED_BASE + 7


@pytest.mark.parametrize("domain", ["long_context/doc_analysis", "long_context/synthetic", "long_context/codebase"])
def test_registry_floor_is_low_and_golden_sample_passes(domain):
    assessment = probes.assess_env_domain(domain)
    assert assessment.golden == "passed" and assessment.golden_checked == 40
    assert assessment.floor is not None and assessment.floor <= 0.05, assessment.probes
