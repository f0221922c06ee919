"""Model and judge rewards (`posttrain.rollout.rewards`): the strict judgement parser's table, the rubric score,
the combination by weights with the cache and the archived details (fake scorers), the judge's batched and
one-at-a-time judgements on a random tiny-dense judge (equal, and not all the same), the reward model's scores of
an exported directory equal to the in-memory model's, and the config's errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import random_model

from posttrain.checkpoints.policy import PolicySource
from posttrain.config import ConfigError
from posttrain.model.tokenizer import Tokenizer
from posttrain.rollout import rewards
from posttrain.rollout.episodes import Sample

CRITERIA = (("correct", 2.0, "the answer is right"), ("clear", 1.0, "easy to follow"))


@pytest.mark.parametrize("text,want,reason", [
    ("correct: 8\nclear: 5", {"correct": 8.0, "clear": 5.0}, ""),
    ("  correct : 10\n\n clear:0.5 \n", {"correct": 10.0, "clear": 0.5}, ""),  # whitespace and blank lines
    ("correct: 11\nclear: 5", None, "outside [0, 10]"),  # out of range
    ("correct: -1\nclear: 5", None, "outside [0, 10]"),
    ("correct: 8", None, "missing criteria ['clear']"),  # missing
    ("", None, "missing criteria ['correct', 'clear']"),
    ("Sure! correct: 8\nclear: 5", None, "not a '<name>: <score>' line"),  # extra text
    ("correct: 8\nclear: 5\nThanks.", None, "not a '<name>: <score>' line"),
    ("correct: 8 points\nclear: 5", None, "not a '<name>: <score>' line"),
    ("correct: eight\nclear: 5", None, "not a '<name>: <score>' line"),  # malformed
    ("correct: 1e1\nclear: 5", None, "not a '<name>: <score>' line"),
    ("correct: 8\ncorrect: 5", None, "scored twice"),
    ("clear: 5\ncorrect: 8", None, "out of order"),
    ("correct: 8\nstyle: 5", None, "unknown criterion 'style'"),
])
def test_parse_judgement_table(text, want, reason):
    scores, why = rewards.parse_judgement(text, CRITERIA, 10.0)
    assert scores == want and reason in why and bool(why) == (want is None)


def test_judgement_score_and_prompt():
    assert rewards.judgement_score({"correct": 8.0, "clear": 5.0}, CRITERIA, 10.0) == pytest.approx((16 + 5) / 30)
    s = rewards.JudgeSettings(source=PolicySource(), template="{rubric}|{prompt}|{reply}|{max_score}",
                              criteria=CRITERIA)
    assert rewards.judge_prompt(s, "a {x}", "b") == ("- correct (weight 2): the answer is right\n- clear (weight 1): "
                                                    "easy to follow|a {x}|b|10")


class FakeScorer:
    """Scores a (prompt, reply) by a function of the reply's length; records every call."""

    def __init__(self, judge=False):
        self.calls, self.judge = [], judge

    def __call__(self, items):
        self.calls.append(list(items))
        if not self.judge:
            return np.asarray([0.1 * len(r) for _, r in items], np.float32)
        return [{"output": f"correct: {len(r) % 11}", "scores": None if len(r) > 3 else {"correct": len(r)},
                 "score": 0.25 if len(r) > 3 else len(r) / 10, "parsed": len(r) <= 3, "reason": ""} for _, r in items]


def sample(tok, reply, reward, status="ok"):
    """A sampled episode as the rollouter makes it: a chat-template prompt, the reply's tokens and its stop token."""
    ids = np.asarray(tok.encode(reply) + [tok.stop_ids[0]], np.int32)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Q?"}], add_generation_prompt=True))
    return Sample(domain="d", group=0, prompt_ids=prompt, segments=[(ids, np.zeros(len(ids)), True)],
                  reward=reward, status=status, texts=[reply], info={"status": status})


def test_rewarder_combines_by_weight_caches_and_archives_details():
    tok = Tokenizer.byte_level()
    model, judge = FakeScorer(), FakeScorer(judge=True)
    settings = rewards.RewardSettings(model_path="x", weights={"env": 2.0, "judge": 0.5})  # model weighs 1
    r = rewards.Rewarder(settings, tok, model=model, judge=judge)
    samples = [sample(tok, "12", 1.0), sample(tok, "12", 1.0), sample(tok, "abcdef", 0.0),
               sample(tok, "zz", 0.0, status="infra_error")]
    perf = r.score(samples)
    assert set(perf) == {"perf/model_reward_s", "perf/judge_reward_s"}
    assert [len(c) for c in model.calls] == [2] and [len(c) for c in judge.calls] == [2]  # duplicates scored once
    assert [reply for _, reply in judge.calls[0]] == ["12", "abcdef"]  # the judge reads the plain reply
    (model_prompt, model_reply), (judge_prompt, _) = model.calls[0][0], judge.calls[0][0]
    assert model_reply == "12<|im_end|>" and "<|im_start|>" in model_prompt  # special tokens kept for the model
    assert "Q?" in judge_prompt and "<|im_start|>" not in judge_prompt
    m12 = 0.1 * len("12<|im_end|>")
    assert samples[0].reward == pytest.approx(2.0 * 1.0 + m12 + 0.5 * 0.2)
    unparsable = 0.25  # the fake's configured score of an unparsable judgement
    assert samples[2].reward == pytest.approx(0.0 + 0.1 * len("abcdef<|im_end|>") + 0.5 * unparsable)
    assert samples[3].reward == 0.0 and "env_reward" not in samples[3].info  # infra error: not scored
    assert samples[0].info["env_reward"] == 1.0 and samples[0].info["model_reward"] == pytest.approx(m12)
    assert samples[2].info["judge"]["parsed"] is False and samples[2].info["judge"]["output"] == "correct: 6"
    r.score([sample(tok, "12", 0.0)])
    assert len(model.calls) == 1 and len(judge.calls) == 1  # cached by (prompt, reply)
    rows = [{"in_batch": True, "details": s.info} for s in samples[:3]]
    m = rewards.reward_metrics(rows)
    assert m["reward/judge_unparsable_rate"] == pytest.approx(1 / 3) and m["reward/env_mean"] == pytest.approx(2 / 3)


@pytest.fixture(scope="module")
def tiny():
    cfg, graphdef, state = random_model("tiny-dense", seed=3, vocab_size=320)
    from posttrain.infra import mesh as mesh_lib

    mesh = mesh_lib.make_mesh({"fsdp": 1}, jax.devices()[:1])
    return cfg, graphdef, state, mesh


def test_judge_batched_equals_one_at_a_time(tiny):
    _, graphdef, state, mesh = tiny
    tok = Tokenizer.byte_level()
    items = [("What is 2 + 3?", "5"), ("Name a colour.", "Blue, I think."), ("Hi", "Hello!"),
             ("Count to three.", "1 2 3")]
    out = {}
    for bs in (4, 1):
        s = rewards.JudgeSettings(source=PolicySource(), template="{prompt} -> {reply}", criteria=CRITERIA,
                                  max_new_tokens=6, batch_size=bs, unparsable_score=-1.0)
        out[bs] = rewards.Judge(s, mesh, graphdef, state, tok)(items)
    assert out[4] == out[1]
    assert len({j["output"] for j in out[4]}) > 1  # the judgements differ: the comparison can fail
    assert all(j["score"] == -1.0 and not j["parsed"] for j in out[4])  # a random judge is unparsable


def test_model_scorer_reads_an_exported_reward_model(tiny, tmp_path):
    from posttrain.checkpoints.reward_model import export_reward_model
    from posttrain.infra import mesh as mesh_lib
    from posttrain.model.reward_head import with_head

    cfg, graphdef, state, mesh = tiny
    tok = Tokenizer.byte_level()
    rm_def, rm_state = with_head(cfg, graphdef, state, mesh, mesh_lib.RULES, score=np.linspace(-1, 1, cfg.d_model))
    export_reward_model(cfg, rm_state, tmp_path, tokenizer=tok)
    scorer = rewards.ModelScorer(rewards.RewardSettings(model_path=str(tmp_path), batch_size=2), mesh, mesh_lib.RULES)
    items = [("<|im_start|>user\nQ?<|im_end|>\n", "yes<|im_end|>"), ("P", "a longer reply"), ("P", "x")]
    got = scorer(items)  # batches of 2, each padded to 64 tokens
    seqs = [tok.encode(p) + tok.encode(r) for p, r in items]
    tokens = np.full((3, max(map(len, seqs))), tok.pad_id, np.int32)
    for i, q in enumerate(seqs):
        tokens[i, :len(q)] = q
    score = jax.jit(lambda st, t, n: nnx.merge(rm_def, st).score_sequences(t, n))
    want = np.asarray(score(rm_state, jnp.asarray(tokens), jnp.asarray([len(q) for q in seqs], jnp.int32)))
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.ptp(got) > 1e-3


@pytest.mark.parametrize("key,value,msg", [
    ("rewards.weights", {"env": 1.0, "critic": 1.0}, "keys among"),
    ("rewards.judge.enabled", True, "judge.enabled needs a rubric"),
    ("rewards.judge.criteria", ({"name": "a b", "weight": 1.0, "description": ""},), "a word"),
    ("rewards.judge.criteria", ({"name": "a", "weight": 0.0, "description": ""},), "weight must be a number > 0"),
    ("rewards.judge.template", "{prompt} {answer}", "must name {prompt} and {reply}"),
    ("rewards.model", "/nonexistent/rm", "rewards.model='/nonexistent/rm': .*no reward model"),
])
def test_config_errors_name_the_key(tmp_path, key, value, msg):
    from helpers import tiny_config

    from posttrain.config.plan import make_run_plan

    with pytest.raises(ConfigError, match=msg):
        make_run_plan(tiny_config(tmp_path, **{key: value}))


def test_rewarded_rollouter_scores_every_round_before_groups_form(monkeypatch):
    """The hook `grpo.build` uses with `rewards.*` (its end-to-end run: tests/posttrain/recipes/test_grpo_rewards.py,
    slow): every draw round's samples are scored as the round returns, its perf seconds added."""
    import json

    from posttrain.rollout.rollouter import Rollouter

    tok = Tokenizer.byte_level()
    drawn = [sample(tok, "12", 1.0), sample(tok, "345", 0.0)]
    monkeypatch.setattr(Rollouter, "_run_fn", lambda self, step, sample_fn, key: (
        lambda batch, size, call: (drawn, {"perf/gen_s": 1.0})))
    r = object.__new__(rewards.RewardedRollouter)
    object.__setattr__(r, "rewarder", rewards.Rewarder(rewards.RewardSettings(model_path="x"), tok,
                                                       model=FakeScorer()))
    got, perf = r._run_fn(0, None, None)(None, 2, 0)
    assert perf["perf/gen_s"] == 1.0 and perf["perf/model_reward_s"] >= 0.0
    assert [s.reward for s in got] == pytest.approx([1.0 + 0.1 * len("12<|im_end|>"), 0.1 * len("345<|im_end|>")])
    m = rewards.reward_metrics([{"in_batch": True, "details": json.dumps(s.info)} for s in got])
    assert m == pytest.approx({"reward/env_mean": 0.5, "reward/model_mean": 0.1 * (12 + 13) / 2})


class RubricJudge:
    """A judge that records each item's rubric and scores a reply by its length."""

    def __init__(self):
        self.items = []

    def __call__(self, items):
        self.items += list(items)
        return [{"output": "", "scores": None, "score": min(len(it[1]) / 10, 1.0), "parsed": True, "reason": ""}
                for it in items]


def test_a_task_files_rubric_and_reward_model_verifiers_fold_into_its_reward():
    """A task-file row `[exact w=3, rubric w=1]`: reward = (3 * exact + 1 * judge score with the ROW's criteria) / 4;
    a row with `reward_model` too adds the model's score; neither gets the run-wide judge or model reward again."""
    tok = Tokenizer.byte_level()
    judge, model = RubricJudge(), FakeScorer()
    r = rewards.Rewarder(rewards.RewardSettings(model_path="x", weights={"env": 2.0}), tok, model=model, judge=judge)
    rubric = [["accurate", 2.0, "facts right"], ["short", 1.0, "one line"]]
    graded = {"computed_weight": 3.0, "parts": [{"name": "rubric", "weight": 1.0, "criteria": rubric}]}
    a, b, plain = sample(tok, "12345", 1.0), sample(tok, "123", 0.0), sample(tok, "12", 1.0)
    a.info["model_graded"] = graded
    b.info["model_graded"] = {"computed_weight": 1.0, "parts": [
        {"name": "rubric", "weight": 1.0, "criteria": rubric}, {"name": "reward_model", "weight": 2.0}]}
    r.score([a, b, plain])
    assert [it[2] for it in judge.items[:2]] == [rubric, rubric] and len(judge.items) == 3  # + plain's global judge
    assert a.reward == pytest.approx(2.0 * (3 * 1.0 + 1 * 0.5) / 4)
    m3 = 0.1 * len("123<|im_end|>")
    assert b.reward == pytest.approx(2.0 * (0.0 + 0.3 + 2 * m3) / 4)
    assert a.info["computed_reward"] == 1.0 and a.info["parts"]["rubric"] == 0.5
    assert "model_reward" not in a.info and "model_reward" in plain.info
    with pytest.raises(ConfigError, match="rubric verifier needs rewards.judge"):
        rewards.Rewarder(rewards.RewardSettings(model_path="x"), tok, model=model).score([sample(tok, "1", 1.0)] + [
            with_model_graded(sample(tok, "9", 1.0), graded)])


def with_model_graded(s, graded):
    """`s` as the task-file env leaves a reply whose row names model-graded verifiers."""
    s.info["model_graded"] = graded
    return s
