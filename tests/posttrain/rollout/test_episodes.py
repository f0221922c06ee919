"""Rollouts: exact token bookkeeping across turns (what the trainer scores is what the sampler produced; env and
template tokens in between are masked), group layout, and the in-process env runner."""
import numpy as np
import pytest

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.rollout import batching
from posttrain.rollout.episodes import Episode, InlineEnvs, run_episodes
from posttrain.generate.sampler import SampleOutput
from posttrain.model.tokenizer import Tokenizer

import faulty_envs
from faulty_envs import FAULTY

TOK = Tokenizer.byte_level()
STOP = TOK.stop_ids[0]


def scripted(replies_by_turn):
    """A sample_fn returning fixed replies per call (turn), with made-up logprobs."""
    calls = []

    def fn(prompts, lengths, key, group_size):
        turn = len(calls)
        calls.append((np.asarray(prompts).copy(), np.asarray(lengths).copy(), group_size))
        n = len(lengths) * group_size
        texts = [replies_by_turn[turn][i % len(replies_by_turn[turn])] for i in range(n)]
        ids = [TOK.encode(t) + [STOP] for t in texts]
        width = max(map(len, ids))
        tokens = np.full((n, width), TOK.pad_id, np.int32)
        logp = np.zeros((n, width), np.float32)
        for i, row in enumerate(ids):
            tokens[i, :len(row)] = row
            logp[i, :len(row)] = -0.1 * (turn + 1)
        return SampleOutput(tokens, logp, np.asarray([len(r) for r in ids], np.int32), np.zeros(n, bool))

    return fn, calls


def test_multi_turn_tool_episode_keeps_policy_tokens_and_masks_tool_output():
    fn, calls = scripted([["```python\nprint(6 * 7)\n```"], ["\\boxed{42}"]])
    task = {"id": "t", "question": "What is 6 * 7?", "answer": "42"}
    eps = [Episode("posttrain/PythonTool-v0", {"max_turns": 3}, task, seed=0, domain="tool")]
    samples, perf = run_episodes(fn, TOK, InlineEnvs(), eps, group_size=2, max_turns=3, key=_key(), pad_id=TOK.pad_id)
    assert len(calls) == 2 and calls[1][2] == 1  # second turn: each sample continues its own context
    for s in samples:
        assert s.reward == 1.0 and s.done and len(s.segments) == 3
        first, bridge, second = s.segments
        assert first[2] and not bridge[2] and second[2]
        bridge_text = TOK.decode(bridge[0].tolist(), skip_special_tokens=False)
        assert "42" in bridge_text and bridge_text.rstrip().endswith("<|im_start|>assistant")
        # the second prompt is exactly prompt + turn 1 + bridge: the sampler continued the same token stream
        ctx = s.prompt_ids + first[0].tolist() + bridge[0].tolist()
        assert any(list(row[:n]) == ctx for row, n in zip(calls[1][0], calls[1][1]))
    batch, m = batching.assemble(samples, advantage_fn("grpo"), group_size=2, pad_id=TOK.pad_id)
    n1, nb, n2 = (len(seg[0]) for seg in samples[0].segments)
    mask = batch.loss_mask_NxC[0]
    assert mask[:n1].all() and not mask[n1:n1 + nb].any() and mask[n1 + nb:n1 + nb + n2].all()
    np.testing.assert_allclose(batch.logp_sample_NxC[0, n1 + nb:n1 + nb + n2], -0.2)
    assert m["response_length/mean"] == n1 + n2


def test_single_turn_groups_share_one_prompt():
    fn, calls = scripted([["The answer is 122.", "no idea"]])
    eps = [Episode("posttrain/Arithmetic-v0", {}, {"question": f"What is {a} + 63?", "answer": str(a + 63)},
                   seed=i) for i, a in enumerate((59, 10))]
    samples, _ = run_episodes(fn, TOK, InlineEnvs(), eps, group_size=2, max_turns=1, key=_key(), pad_id=TOK.pad_id)
    assert len(calls) == 1 and calls[0][0].shape[0] == 2 and calls[0][2] == 2  # P prompts, G samples each
    assert [s.group for s in samples] == [0, 0, 1, 1]
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.0]


def _key():
    import jax

    return jax.random.key(0)


def test_host_sharded_envs_step_only_their_share_and_return_every_result(monkeypatch):
    """Two processes, simulated by two threads (one `allgather_objects` rendezvous per call): each resets and steps
    only its contiguous block of episodes (2 and 3 of 5), also on a later turn that steps a subset, and both get
    every result in the caller's order."""
    import threading

    from posttrain.infra import distributed
    from posttrain.rollout.episodes import HostShardedEnvs

    class Recorder:  # a local EnvRunner that echoes which of its own episodes it stepped
        def __init__(self):
            self.episodes, self.calls = [], []

        def reset(self, episodes):
            self.episodes = list(episodes)
            return [(f"obs {e}", {}) for e in episodes]

        def step(self, actions, indices):
            self.calls.append(list(indices))
            return [(f"{self.episodes[i]}:{a}", 0.0, False, False, {}) for i, a in zip(indices, actions)]

    local, barrier, slots = threading.local(), threading.Barrier(2, timeout=30), [None, None]

    def allgather(obj):
        slots[local.pid] = obj
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out

    monkeypatch.setattr(distributed, "allgather_objects", allgather)
    monkeypatch.setattr(distributed, "host_share", lambda n: range(n * local.pid // 2, n * (local.pid + 1) // 2))
    runners, results, errors = [Recorder(), Recorder()], [None, None], []

    def process(pid):
        local.pid = pid
        try:
            envs = HostShardedEnvs(runners[pid])
            results[pid] = (envs.reset(list(range(5))), envs.step(["a"] * 5), envs.step(["b", "c"], [1, 4]),
                            envs.episodes, envs.env_steps)
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=process, args=(pid,)) for pid in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert results[0][:3] == results[1][:3]
    first, second, third = results[0][:3]
    assert [obs for obs, _ in first] == [f"obs {e}" for e in range(5)]
    assert [r[0] for r in second] == [f"{e}:a" for e in range(5)]
    assert [r[0] for r in third] == ["1:b", "4:c"]
    assert runners[0].episodes == [0, 1] and runners[1].episodes == [2, 3, 4]
    assert runners[0].calls == [[0, 1], [1]] and runners[1].calls == [[0, 1, 2], [2]]  # local indices
    assert results[0][3:] == (2, 3) and results[1][3:] == (3, 4)  # (episodes, env steps) each process ran


class _Turns:
    """An EnvRunner whose episodes end as `plan` says: {turn: (terminated, truncated, status)}; other turns go on
    with the status a tool run reports ("ok"), or with none (`between=None`: a multi-turn env that sets a status
    only when it ends the episode)."""

    def __init__(self, plan, between: str | None = "ok"):
        self.plan, self.turns, self.between = plan, {}, between

    def reset(self, episodes):
        self.turns = {i: 0 for i in range(len(episodes))}
        return [("question", {}) for _ in episodes]

    def step(self, actions, indices=None):
        out = []
        for i in (range(len(actions)) if indices is None else indices):
            self.turns[i] += 1
            term, trunc, status = self.plan.get(self.turns[i], (False, False, self.between))
            info = {} if status is None else {"status": status}
            out.append(("tool output", float(term and status == "ok"), term, trunc, info))
        return out


# kind: a status reports the decisive cause: an episode cut by env.max_turns is "truncated", not the last tool
# run's "ok"; an episode the env ended keeps the env's own verdict
@pytest.mark.parametrize("max_turns,plan,status,reward", [
    (1, {}, "truncated", 0.0),
    (3, {}, "truncated", 0.0),  # configs/tool.py's 3 turns with the env's own limit later (its default 4)
    (3, {2: (True, False, "ok")}, "ok", 1.0),
    (3, {3: (True, False, "wrong")}, "wrong", 0.0),
    (3, {2: (False, True, "wrong")}, "wrong", 0.0),  # the env truncated it itself (its on_truncate verdict)
])
def test_an_episode_cut_by_max_turns_is_truncated_not_ok(max_turns, plan, status, reward):
    fn, _ = scripted([["```python\nprint(1)\n```"]] * 3)
    eps = [Episode("any", {}, {"id": "t"}, seed=0, domain="tool")]
    samples, _ = run_episodes(fn, TOK, _Turns(plan), eps, group_size=2, max_turns=max_turns, key=_key(),
                              pad_id=TOK.pad_id)
    assert [(s.status, s.reward, s.done) for s in samples] == [(status, reward, True)] * 2
    if status == "truncated":
        assert all(s.info["reason"] == f"env.max_turns={max_turns} reached before the env ended the episode"
                   for s in samples)


def test_turns_that_go_on_may_leave_the_status_out_and_the_last_one_sets_it():
    """A user trial's multi-turn env returned info {} on the turns before its last: every episode ended as an
    infra_error at turn 1. Only the step that ends the episode must carry a status."""
    fn, _ = scripted([["a"]] * 3)
    eps = [Episode("any", {}, {"id": "t"}, seed=0, domain="tool")]
    samples, _ = run_episodes(fn, TOK, _Turns({3: (True, False, "ok")}, between=None), eps, group_size=2,
                              max_turns=3, key=_key(), pad_id=TOK.pad_id)
    assert [(s.status, s.reward, s.done, len(s.texts)) for s in samples] == [("ok", 1.0, True, 3)] * 2
    fn, _ = scripted([["a"]] * 2)  # never ended by the env: cut by max_turns, as before
    cut, _ = run_episodes(fn, TOK, _Turns({}, between=None), eps, group_size=1, max_turns=2, key=_key(),
                          pad_id=TOK.pad_id)
    assert [(s.status, s.done) for s in cut] == [("truncated", True)]


MODES = ["reset", "step", "env_infra", *sorted(faulty_envs.RESETS), *sorted(faulty_envs.REFUSED),
         *sorted(faulty_envs.ACCEPTED)]


def expected(mode: str, runner: str = "inline") -> tuple:
    """(status, reward, counts, reason or None) of a sample of the faulty env in `mode` (`faulty_envs`)."""
    if mode in faulty_envs.ACCEPTED:
        reward, status, _ = faulty_envs.ACCEPTED[mode]
        return status, reward, True, None
    reason = {"reset": "reset raised RuntimeError: sandbox failed to start",
              "step": "step raised RuntimeError: harness crashed", "env_infra": "flaky sandbox"}.get(mode)
    if mode in faulty_envs.RESETS:  # a reset result that is no (str, dict) pair: as an exception in reset
        reason = f"reset raised TypeError: env {FAULTY!r}: {faulty_envs.RESETS[mode][1]}"
    if runner == "pool" and mode == "four":  # the worker unpacks gymnasium's 5 itself
        reason = "step raised ValueError: not enough values to unpack (expected 5, got 4)"
    return "infra_error", 0.0, False, reason or f"env {FAULTY!r} {faulty_envs.REFUSED[mode]}"


def run_faulty(runner, modes=MODES, stream=False, **kw):
    fn, _ = scripted([["x"]])
    sample_fn = (lambda *a, on_rows=None: fn(*a)) if stream else fn  # streaming: every row scored at finish
    eps = [Episode(FAULTY, {}, {"mode": m}, seed=i, domain=m) for i, m in enumerate(modes)]
    samples, _ = run_episodes(sample_fn, TOK, runner, eps, group_size=1, max_turns=1, key=_key(), pad_id=TOK.pad_id,
                              stream=stream, **kw)
    return samples


def outcome(s) -> tuple:
    reason = s.info.get("reason") if s.status == "infra_error" else None
    return s.status, s.reward, s.counts, reason if reason is None else reason.splitlines()[0]


# kind: everything a user's env can get wrong in a reset (an exception, no (str, dict) pair) or a step (an exception,
# a reward that is no real number, non-finite or beyond env.max_abs_reward, an unknown or missing status, an info or
# step tuple of the wrong shape) ends only that episode, as an infra_error naming the env (never scored); the valid
# rewards of the same batch score as floats
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "streaming"])
def test_env_faults_end_their_episode_as_infra_error_and_the_others_go_on(stream):
    runner = InlineEnvs()
    samples = run_faulty(runner, stream=stream)
    assert {m: outcome(s) for m, s in zip(MODES, samples)} == {m: expected(m) for m in MODES}
    assert all(s.done and type(s.reward) is float for s in samples)
    # the exceptions and the malformed resets (refused in the runner's reset); the step results' refusals are not the
    # runner's
    assert runner.infra_errors == 2 + len(faulty_envs.RESETS)


def test_env_workers_pass_faulty_results_on_to_the_same_check():
    """The EnvPool worker (process backend; the Ray backend runs the same `EnvHost`) no longer coerces a reward
    (float("1.0") scored 1) or an info: its results meet the same check as the in-process runner's."""
    from envs.pool.processes import EnvPool

    with EnvPool(num_workers=1, step_timeout_s=30.0) as pool:
        samples = run_faulty(pool)
    assert {m: outcome(s) for m, s in zip(MODES, samples)} == {m: expected(m, "pool") for m in MODES}


def test_the_runners_bound_applies_to_every_caller_evaluations_included():
    """`HostShardedEnvs.max_abs_reward` (the run's env.max_abs_reward on the Rollouter's runner) is the bound of every
    run_episodes call on that runner: the evaluation runner's (`eval.runner.sample_groups`, which names none) too;
    an explicit max_abs_reward overrides it."""
    from posttrain.eval import runner as eval_runner
    from posttrain.rollout.episodes import HostShardedEnvs

    modes = ["ok", "np_float", "-bound"]
    eps = [Episode(FAULTY, {}, {"mode": m}, seed=i, domain=m) for i, m in enumerate(modes)]
    fn, _ = scripted([["x"]])
    groups = eval_runner.sample_groups(fn, TOK, HostShardedEnvs(InlineEnvs(), max_abs_reward=0.5), eps, batch_size=8)
    got = [outcome(group[0]) for _, group, _ in groups]
    assert got == [("infra_error", 0.0, False, f"env {FAULTY!r} returned reward 1.0, beyond env.max_abs_reward=0.5 "
                    "(a reward scale bug? rescale the env's rewards or raise env.max_abs_reward)"),
                   ("wrong", 0.5, True, None), ("infra_error", 0.0, False, f"env {FAULTY!r} returned reward "
                    "-10000.0, beyond env.max_abs_reward=0.5 (a reward scale bug? rescale the env's rewards or raise "
                    "env.max_abs_reward)")]
    assert [outcome(s) for s in run_faulty(HostShardedEnvs(InlineEnvs(), max_abs_reward=0.5), modes,
                                           max_abs_reward=1e4)] == [expected(m) for m in modes]
    assert HostShardedEnvs(InlineEnvs()).max_abs_reward == 1e4


def test_per_episode_turns_check_each_result_and_name_its_env():
    """The rollout engine's per-episode turns (`rollout.per_episode`) step each env on its own and meet the same check:
    a refused result ends that episode as an infra_error naming its env id, the others go on."""
    import types

    from posttrain.rollout import per_episode
    from posttrain.rollout.episodes import Sample

    modes = ["text", "ok", "huge"]
    runner = InlineEnvs()
    runner.reset([Episode(FAULTY, {}, {"mode": m}, seed=i) for i, m in enumerate(modes)])
    reply = TOK.encode("x") + [STOP]

    def generate(requests, key, on_finish, follow_after=0):
        queue = list(enumerate(requests))
        while queue:
            index, _ = queue.pop(0)
            done = types.SimpleNamespace(tokens=reply, logprobs=[-0.1] * len(reply), truncated=False, versions=None,
                                         routing=None)
            if (nxt := on_finish(index, done)) is not None:
                queue.append((index + len(requests), nxt))
        return []

    samples = [Sample(domain=m, group=i, prompt_ids=[1, 2]) for i, m in enumerate(modes)]
    per_episode.run(generate, lambda ctx: types.SimpleNamespace(max_new_tokens=4), 64, TOK, runner, samples,
                    [[1, 2]] * 3, group_size=1, max_turns=2, key=None, env_ids=[FAULTY] * 3)
    assert [outcome(s) for s in samples] == [expected(m) for m in modes]
