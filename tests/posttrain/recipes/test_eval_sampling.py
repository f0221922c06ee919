"""`gate_hook.sample_suite` (issue 22 item 8): domains with the same budget share sampler batches (fewer calls, one
SamplingParams per group), records come back in suite order with domain-local indices and each domain's own
scorer, format and area, and every domain gets its share of the seconds; a scripted sampler, no model."""
import sys
import types

from posttrain.eval import suite as suite_lib
from posttrain.eval import gate_hook
from posttrain.rollout.episodes import InlineEnvs

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/tests/posttrain/eval")
from test_eval_runner import TOK, answer, scripted  # noqa: E402  (the scripted sampler of the runner tests)

ARITH = {"env": "posttrain/Arithmetic-v0", "kwargs": {"digits": 1, "num_test": 20}, "format": "number"}
SUITE = {"name": "t", "defaults": {"split": "test", "tasks": 5, "max_new_tokens": 8},
         "areas": {"a": {"trained": True, "domains": {"one": ARITH, "two": {**ARITH, "tasks": 3,
                                                                            "scorer": "last_integer"}}},
                   "b": {"domains": {"long": {**ARITH, "tasks": 2, "max_new_tokens": 16}}}}}


def _run(batch_size):
    built, skipped = suite_lib.resolve(suite_lib.parse_suite(SUITE))
    assert not skipped
    calls, params, keys = [], [], []
    reply = scripted(lambda p, g: f"The sum is {answer(p)}")

    def sample_fn(policy, sampling):
        params.append(sampling)

        def fn(prompts, lengths, key, group_size, **kwargs):
            calls.append((sampling.max_new_tokens, len(prompts)))
            keys.append(key)
            return reply(prompts, lengths, key, group_size)
        return fn

    rollouter = types.SimpleNamespace(sample_fn=sample_fn, tokenizer=TOK, runner=InlineEnvs())
    settings = types.SimpleNamespace(seed=1, eval_config=types.SimpleNamespace(batch_size=batch_size),
                                     sampling_config=types.SimpleNamespace(system_prompt="", prompt_bucket=16))
    return (*gate_hook.sample_suite(settings, built, rollouter, None), calls, params, built, keys)


def test_domains_with_one_budget_share_batches_and_keep_their_own_settings():
    records, seconds, calls, params, built, _ = _run(batch_size=4)
    assert [g for g in gate_hook.budget_groups(built)] == [(8, 0.0, 1, 1), (16, 0.0, 1, 1)]
    assert calls == [(8, 4), (8, 4), (16, 2)]  # 5 + 3 tasks at 8 tokens in 2 calls (3 calls one domain at a time)
    assert [p.max_new_tokens for p in params] == [8, 16]
    assert [(r["domain"], r["index"]) for r in records] == (
        [("one", i) for i in range(5)] + [("two", i) for i in range(3)] + [("long", 0), ("long", 1)])
    assert {r["area"] for r in records if r["domain"] == "long"} == {"b"}
    assert all(r["correct"] == [True] and r["formatted"] == [True] for r in records)
    assert [r["task_id"] for r in records if r["domain"] == "two"] == [f"arithmetic-test-{i}" for i in range(3)]
    assert set(seconds) == {"one", "two", "long", "total"} and all(v > 0 for v in seconds.values())
    assert seconds["one"] + seconds["two"] + seconds["long"] <= seconds["total"]


def test_a_group_of_one_domain_samples_as_before():
    """A single-domain group's stream is the domain's own key (`domain_key(key, name)`): the gate's stored
    baselines keep their samples; the shared group's key is its names joined by "+"."""
    import jax
    import numpy as np

    from posttrain.eval.runner import domain_key

    records, _, calls, _, _, keys = _run(batch_size=64)
    assert calls == [(8, 8), (16, 2)] and len(records) == 10
    root = jax.random.key(1)
    for got, name in zip(keys, ["one+two", "long"]):
        want = jax.random.fold_in(jax.random.fold_in(domain_key(root, name), 0), 0)  # call start, turn 0
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
