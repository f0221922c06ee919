"""posttrain.rollout.chat with a template that defines tool calls, used as it is: Qwen3's chat template
(tests/golden/qwen3_chat_template.jinja, Qwen3's tokenizer_config.json template as TRL 1.16 stores it in
trl/chat_templates/qwen3.jinja) on the byte tokenizer, so no download. The first prompt renders the env's tools
through ``tools=``, tool results come back as the template's ``<tool_response>`` turns, a tool call the template
renders parses back to the same call, a template that re-renders the reply is refused, and a 6-turn episode's
trainer logprobs equal the sampler's (the tolerance of test_sampler.py) on a tiny Qwen3-shaped model."""
import functools
import pathlib

import gymnasium

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envs import base
from envs.tasks.repo_fix import tools as repo_tools
from helpers import random_model
from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.learn.logprobs import score_logprobs
from posttrain.model.tokenizer import Tokenizer
from posttrain.rollout import batching, chat
from posttrain.generate.backend import EngineSampler, EngineSamplerSettings
from posttrain.rollout.episodes import Episode, InlineEnvs, run_episodes, turn_bridge
from posttrain.generate.sampler import SamplingParams, sample

BYTES = Tokenizer.byte_level()
TEMPLATE = (pathlib.Path(__file__).resolve().parents[2] / "golden" / "qwen3_chat_template.jinja").read_text()
QWEN3 = Tokenizer(BYTES.backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TEMPLATE)
ECHO = {"type": "function", "function": {"name": "echo", "description": "Echo the text.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
TURNS = 6


class ToolChatEnv(base.TextEnv):
    """Scripted multi-turn tool env: every turn's reply gets a tool result (as text and as a tool message); the
    episode ends with reward 1 at turn TURNS."""

    def __init__(self, self_check: bool = False):
        tasks = base.ListTaskSource([{"id": f"t{i}", "q": f"Call echo {TURNS} times ({i})."} for i in range(2)],
                                    split="train")
        super().__init__(tasks, max_turns=TURNS, self_check=self_check)

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        return obs + "\n\nTOOLS: echo", {**info, "tools": [ECHO], "tools_prompt": "TOOLS: echo"}

    def first_observation(self, task):
        return task["q"]

    def turn_step(self, action):
        if self.turn >= TURNS:
            return "", 1.0, True, {"status": "ok"}
        text = f"echo {self.turn}: {len(action)} chars"
        return f"<tool_response>{text}</tool_response>", 0.0, False, {
            "status": "ok", "messages": [{"role": "tool", "name": "echo", "content": text}]}

    def golden_episodes(self):
        return []


if "test/ToolChat-v0" not in gymnasium.registry:
    gymnasium.register("test/ToolChat-v0", entry_point=ToolChatEnv)


def test_renders_tools_tells_qwen3_from_chatml():
    assert chat.renders_tools(QWEN3) and not chat.renders_tools(BYTES)


def test_first_prompt_renders_the_tools_through_the_template_and_drops_their_text():
    info = {"tools": [ECHO], "tools_prompt": "TOOLS: echo"}
    native = chat.prompt_text(QWEN3, "Fix it.\n\nTOOLS: echo", "Be brief.", info)
    assert native.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and '"name": "echo"' in native
    assert native.endswith("<|im_start|>user\nFix it.<|im_end|>\n<|im_start|>assistant\n")
    assert "TOOLS: echo" not in native
    plain = chat.prompt_text(BYTES, "Fix it.\n\nTOOLS: echo", "", info)  # ChatML: the schema stays in the text
    assert plain == "<|im_start|>user\nFix it.\n\nTOOLS: echo<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("stop", [True, False])
def test_tool_results_come_back_as_the_templates_tool_response_turn(stop):
    info = {"messages": [{"role": "tool", "name": "a", "content": "one"}, {"role": "tool", "content": "two"}]}
    text = QWEN3.decode(turn_bridge(QWEN3, "<think>\nhm\n</think>\n\nx", "ignored", stop, info),
                        skip_special_tokens=False)
    assert text == (("" if stop else "<|im_end|>") + "\n<|im_start|>user\n<tool_response>\none\n</tool_response>\n"
                    "<tool_response>\ntwo\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    chatml = BYTES.decode(turn_bridge(BYTES, "x", "obs", stop, info), skip_special_tokens=False)
    assert chatml == ("" if stop else "<|im_end|>") + "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="'role': 'tool' | 'user'"):
        turn_bridge(QWEN3, "x", "obs", stop, {"messages": [{"role": "assistant", "content": "x"}]})


def test_a_template_that_rewrites_the_reply_fails_the_extension_check():
    shouting = Tokenizer(BYTES.backend, eos_token="<|im_end|>", chat_template=(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    with pytest.raises(ValueError, match="does not extend a conversation turn by turn"):
        turn_bridge(shouting, "x", "obs", True)


def test_a_tool_call_the_template_renders_parses_back_to_the_same_call():
    arguments = {"path": "toolbox/core.py", "content": 'd = {"a": [1, {"b": 2}]}\n'}  # nested JSON in a string
    text = QWEN3.apply_chat_template([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Writing it.", "tool_calls": [
            {"type": "function", "function": {"name": "write_file", "arguments": arguments}},
            {"type": "function", "function": {"name": "submit", "arguments": {}}}]}], add_generation_prompt=False)
    reply = text.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    calls, errors = repo_tools.parse_tool_calls(reply)
    assert calls == [repo_tools.ToolCall("write_file", arguments), repo_tools.ToolCall("submit", {})] and not errors


@pytest.mark.parametrize("backend", ["dense", "engine", "engine-per-episode"])
def test_six_turn_episode_trainer_logprobs_equal_the_samplers(backend):
    """Six turns of a tool episode sampled by the dense sampler or the rollout engine (`sampling.backend`), the
    engine turn by turn or per episode (`rollout.per_episode`: each episode's next turn queued when its env step
    returns): the trainer's logprobs of the policy tokens equal the sampler's; the engine prefills each later
    turn's context from the pages of the turns before it (its prefix cache) and tags every token with version 0;
    per episode, a later turn prefills only the reply's last token and the bridge."""
    cfg, graphdef, state = random_model("tiny-qwen3", vocab_size=320)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    calls = []
    per_episode = backend == "engine-per-episode"
    engine = EngineSampler(graphdef, EngineSamplerSettings(num_slots=2, max_seq_len=1024, per_episode=per_episode)) \
        if backend != "dense" else None
    engine_fn = engine.sample_fn((state,), params, QWEN3.stop_ids, QWEN3.pad_id) if engine else None

    def sample_fn(prompts, lengths, key, group_size):
        calls.append(np.asarray(prompts).shape)
        if engine_fn is not None:
            return engine_fn(prompts, lengths, key, group_size)
        return sample(graphdef, state, jnp.asarray(prompts), jnp.asarray(lengths), key, group_size=group_size,
                      params=params, stop_ids=QWEN3.stop_ids, pad_id=QWEN3.pad_id)

    episodes = [Episode("test/ToolChat-v0", {}, {"id": f"t{i}", "q": f"Call echo {TURNS} times ({i})."}, seed=i)
                for i in range(2)]
    samples, _ = run_episodes(engine_fn if per_episode else sample_fn, QWEN3, InlineEnvs(), episodes,
                              group_size=1, max_turns=TURNS, key=jax.random.key(0), pad_id=QWEN3.pad_id, bucket=512)
    assert calls == [] if per_episode else len(calls) == TURNS and len(set(calls)) == 1  # one shape for all turns
    for s in samples:
        assert (s.reward, s.status, len(s.texts)) == (1.0, "ok", TURNS)
        assert [policy for _, _, policy in s.segments] == [True, False] * (TURNS - 1) + [True]
        prompt = QWEN3.decode(s.prompt_ids, skip_special_tokens=False)
        assert '"name": "echo"' in prompt and "TOOLS: echo" not in prompt
        bridges = [QWEN3.decode(t.tolist(), skip_special_tokens=False) for t, _, policy in s.segments if not policy]
        assert all(f"<tool_response>\necho {k + 1}: " in b for k, b in enumerate(bridges))
    batch, _ = batching.assemble(samples, advantage_fn("grpo"), group_size=1, pad_id=QWEN3.pad_id, packed=False)
    logp = jax.jit(lambda b: score_logprobs(nnx.merge(graphdef, state), b, 1.0, chunk=64)[0].logp_BxT)(
        jax.tree.map(jnp.asarray, batch))
    mask = np.asarray(batch.loss_mask_NxC)
    assert mask.sum() == sum(len(t) for s in samples for t, _, policy in s.segments if policy)
    diff = np.abs(np.asarray(logp) - batch.logp_sample_NxC)[mask]
    assert diff.mean() <= 1e-4 and diff.max() <= 1e-3, (diff.mean(), diff.max())
    if engine is not None:
        m = engine.pop_metrics()
        first = sum(len(s.prompt_ids) + len(s.segments[0][0]) for s in samples)  # turn 1's prompt and reply
        assert m["rollout/prefix_cached_tokens"] >= first - 2 * 16  # later turns: all but a partial last page
        assert all(set(np.concatenate(s.versions).tolist()) == {0} for s in samples)
        if per_episode:  # turn k > 1 prefills the last reply token and the bridge: the cache holds the rest
            new = sum(len(s.prompt_ids) + sum(1 + len(t) for t, _, policy in s.segments if not policy)
                      for s in samples)
            assert m["rollout/prefill_tokens"] <= new, (m["rollout/prefill_tokens"], new)


def test_per_episode_turns_are_queued_as_each_env_step_returns():
    """One engine slot, two six-turn episodes: per episode (`rollout.per_episode`) episode 0's next turn is queued
    first as soon as its env step returns, so its six env steps come before episode 1's first; turn by turn every
    episode's turn k steps before any turn k + 1. Both give whole episodes (reward 1, six replies)."""
    cfg, graphdef, state = random_model("tiny-qwen3", vocab_size=320)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    engine = EngineSampler(graphdef, EngineSamplerSettings(num_slots=1, max_seq_len=1024, per_episode=True))
    episodes = [Episode("test/ToolChat-v0", {}, {"id": f"t{i}", "q": f"Call echo {TURNS} times ({i})."}, seed=i)
                for i in range(2)]
    orders = {}
    for mode in ("per_episode", "by_turn"):
        steps, envs = [], InlineEnvs()
        step = envs.step
        envs.step = lambda actions, indices=None: steps.extend(indices or range(len(actions))) or step(actions, indices)
        fn = engine.sample_fn((state,), params, QWEN3.stop_ids, QWEN3.pad_id)
        if mode == "by_turn":
            fn = functools.partial(fn)  # no `generate` attribute: run_episodes goes turn by turn
        samples, _ = run_episodes(fn, QWEN3, envs, episodes, group_size=1, max_turns=TURNS, key=jax.random.key(0),
                                  pad_id=QWEN3.pad_id, bucket=512)
        assert all((s.reward, s.status, len(s.texts)) == (1.0, "ok", TURNS) for s in samples), mode
        orders[mode] = (list(steps), [[t.tolist() for t, _, _ in s.segments] for s in samples])
    assert orders["per_episode"][0] == [0] * TURNS + [1] * TURNS
    assert orders["by_turn"][0] == [0, 1] * TURNS
    assert orders["per_episode"][1] == orders["by_turn"][1]  # greedy: the same tokens either way


def test_per_episode_env_steps_overlap_decode_and_give_the_same_episodes():
    """sampling.engine_env_overlap: with env_overlap=2 each env step runs on the episode-env thread while the
    engine decodes the other episode (steps of 50 ms, overlapping at least one decode step), and the episodes
    equal env_overlap=0's (greedy tokens, rewards, statuses)."""
    import threading
    import time

    cfg, graphdef, state = random_model("tiny-qwen3", vocab_size=320)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    episodes = [Episode("test/ToolChat-v0", {}, {"id": f"t{i}", "q": f"Call echo {TURNS} times ({i})."}, seed=i)
                for i in range(2)]
    got = {}
    for overlap in (0, 2):
        engine = EngineSampler(graphdef, EngineSamplerSettings(num_slots=2, max_seq_len=1024, per_episode=True,
                                                               env_overlap=overlap))
        envs, threads, spans, chunks = InlineEnvs(), [], [], []
        step = envs.step

        def slow_step(actions, indices=None, step=step, threads=threads, spans=spans):
            threads.append(threading.current_thread().name)
            t = time.perf_counter()
            time.sleep(0.05)
            out = step(actions, indices)
            spans.append((t, time.perf_counter()))
            return out
        envs.step = slow_step
        engine.chunk_hook = lambda e, c, chunks=chunks: chunks.append(time.perf_counter())
        fn = engine.sample_fn((state,), params, QWEN3.stop_ids, QWEN3.pad_id)
        assert fn.env_overlap == overlap
        samples, _ = run_episodes(fn, QWEN3, envs, episodes, group_size=1, max_turns=TURNS, key=jax.random.key(0),
                                  pad_id=QWEN3.pad_id, bucket=512)
        got[overlap] = [(s.reward, s.status, [t.tolist() for t, _, _ in s.segments]) for s in samples]
        assert len(threads) == 2 * TURNS
        inside = sum(any(a < c < b for a, b in spans) for c in chunks)
        if overlap:
            assert set(threads) == {"episode-env_0"} and inside >= 1, (set(threads), inside)
        else:
            assert set(threads) == {threading.current_thread().name} and inside == 0
    assert got[0] == got[2] and all(g[:2] == (1.0, "ok") for g in got[2])
