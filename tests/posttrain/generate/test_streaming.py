"""Streaming scoring (issue 24 item 4): with rollout.stream_chunk > 0 the samples that have finished decoding are
stepped in the env runner while the others still decode, and the samples (tokens, logprobs, rewards, statuses,
turns) equal the non-streaming path's on the same seeds (a scripted sampler here; the real sampler's decode loop
hands over its finished rows without changing any output: test_sampler.py's streaming case)."""
import time

import numpy as np
import pytest

from posttrain.model.tokenizer import Tokenizer
from posttrain.rollout import episodes as episodes_lib
from posttrain.generate import streaming
from posttrain.generate.sampler import SampleOutput

BYTES = Tokenizer.byte_level()


class ReplyEnvs:
    """A runner whose reward depends on the episode (its seed) and its reply, so a reply stepped in the wrong
    episode changes the rewards; episodes with an odd seed take two turns. Records each step call's episodes and
    whether the sampler had returned (`returned`, set by the test's sample_fn wrapper)."""

    def __init__(self):
        self.calls, self.returned = [], False

    def reset(self, episodes):
        self.seeds, self.turns = [ep.seed for ep in episodes], [0] * len(episodes)
        return [(f"task {ep.task['q']}", {"status": "ok"}) for ep in episodes]

    def step(self, actions, indices=None):
        indices = list(range(len(actions))) if indices is None else list(indices)
        self.calls.append((indices, self.returned))
        out = []
        for i, a in zip(indices, actions):
            self.turns[i] += 1
            done = self.seeds[i] % 2 == 0 or self.turns[i] == 2
            reward = (sum(map(ord, a)) * 7 + self.seeds[i]) % 5 / 4
            out.append(("again", reward, done, False, {"status": "ok" if reward else "wrong"}))
        return out


STOP = BYTES.stop_ids[0]


def scripted(every: int = 2):
    """A sample_fn (prompts, lengths, key, G, on_rows=None) with replies of lengths that differ by row and by
    key (each ends with the stop token); given `on_rows`, it hands over the rows finished every `every` steps as
    the sampler's decode loop does (`generate.streaming.emit`): finished rows, all tokens, all lengths."""

    def fn(prompts, lengths, key, group_size, on_rows=None):
        import jax

        n = len(lengths) * group_size
        seed = int(jax.random.randint(key, (), 0, 1 << 20))
        lens = np.asarray([1 + (seed + 5 * r) % 9 for r in range(n)], np.int32)
        tokens = np.full((n, 10), BYTES.pad_id, np.int32)
        for r, k in enumerate(lens):
            tokens[r, :k - 1] = 97 + (seed + np.arange(k - 1) * (r + 1)) % 26
            tokens[r, k - 1] = STOP
        if on_rows is not None:
            for t in range(every, 10, every):
                on_rows(lens <= t, tokens, lens)
        logp = -np.where(np.arange(10)[None] < lens[:, None], 0.25, 0.0).astype(np.float32)
        return SampleOutput(tokens, logp, lens, np.zeros(n, bool))

    return fn


def _run(stream: bool):
    import jax

    envs, fn = ReplyEnvs(), scripted()

    def sample_fn(*args, on_rows=None):
        """The scripted sampler; each delivery of new rows waits (up to 5 s) until the scorer has stepped them,
        as a sampler still decoding would let it."""
        envs.returned, seen, start = False, set(), len(envs.calls)

        def sink(finished, tokens, lengths):
            new = set(np.flatnonzero(finished).tolist()) - seen
            on_rows(finished, tokens, lengths)
            if new:
                seen.update(new)
                deadline = time.monotonic() + 5.0
                while len(envs.calls) < start + len(seen) and time.monotonic() < deadline:
                    if sum(len(c) for c, _ in envs.calls[start:]) >= len(seen):
                        break
                    time.sleep(0.002)

        out = fn(*args, **({"on_rows": sink} if on_rows else {}))
        envs.returned = True
        return out

    eps = [episodes_lib.Episode("fake", {}, {"q": p}, seed=p, domain="d") for p in range(3)]
    samples, perf = episodes_lib.run_episodes(sample_fn, BYTES, envs, eps, group_size=4, max_turns=2,
                                         key=jax.random.key(5), pad_id=BYTES.pad_id, stream=stream)
    return samples, envs.calls


def test_streamed_samples_equal_the_batch_path_and_are_stepped_while_others_decode():
    """Same seeds, 3 prompts x 4 samples, two turns for odd-seeded episodes: the same samples either way; with
    streaming each episode is stepped once per turn, most before the sampler returned, in several deliveries, at
    its own episode index (a reply stepped in another episode changes the rewards)."""
    plain, plain_calls = _run(False)
    streamed, calls = _run(True)
    second = [i for i in range(12) if i // 4 % 2 == 1]  # episodes of prompt 1 (seed 1) take a second turn
    assert plain_calls == [(list(range(12)), True), (second, True)]  # one call per turn, after the sampler
    early = [i for c, returned in calls if not returned for i in c]
    assert len(calls) > 4 and 0 < len(early) < 16  # mid-decode deliveries, and rows left for the end
    assert sorted(i for c, _ in calls for i in c) == sorted(list(range(12)) + second)  # once per turn each
    assert len({s.completion_len for s in plain}) > 2 and len(rewards := {s.reward for s in plain}) > 2, rewards
    for a, b in zip(plain, streamed):
        assert (a.reward, a.status, a.done, a.truncated, a.texts) == (b.reward, b.status, b.done, b.truncated, b.texts)
        assert len(a.segments) == len(b.segments)
        for (ta, la, pa), (tb, lb, pb) in zip(a.segments, b.segments):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_array_equal(la, lb)
            assert pa == pb


def test_a_runner_error_reaches_the_caller_and_a_changed_row_is_caught():
    """An env runner that raises in the scorer's thread: run_episodes raises it; a streamed reply that is not
    the final one (a sampler bug) raises RuntimeError."""

    class Broken(ReplyEnvs):
        def step(self, actions, indices=None):
            raise OSError("env workers gone")

    scorer = streaming.TurnScorer(Broken(), [0, 1], lambda ids: "x" * len(ids))
    scorer.rows_finished(np.array([True, False]), np.zeros((2, 4), np.int32), np.array([2, 4]))
    with pytest.raises(OSError, match="env workers gone"):
        scorer.finish(np.zeros((2, 4), np.int32), np.array([2, 4]))
    scorer = streaming.TurnScorer(ReplyEnvs(), [0, 1], lambda ids: "x" * len(ids))
    scorer.runner.reset([episodes_lib.Episode("fake", {}, {"q": 0}, seed=0)] * 2)
    scorer.rows_finished(np.array([True, False]), np.zeros((2, 4), np.int32), np.array([2, 4]))
    with pytest.raises(RuntimeError, match="streamed row 0 changed"):
        scorer.finish(np.zeros((2, 4), np.int32), np.array([3, 4]))


def test_stream_ids_route_to_their_sink_and_unregistered_ones_are_skipped():
    got = []
    i = streaming.register(lambda *a: got.append(a))
    streaming.deliver(np.int32(i), [True], [[1, 2]], [2])
    streaming.unregister(i)
    streaming.deliver(np.int32(i), [True], [[1, 2]], [2])
    assert len(got) == 1 and got[0][0].dtype == bool and got[0][1].tolist() == [[1, 2]]


@pytest.mark.slow  # a full tiny run (~3 min at load 14); the identity is covered fast above and in test_sampler.py
def test_the_tiny_golden_reproduces_with_streaming_on(tmp_path):
    """configs/tiny.py for 3 steps at max_staleness=0 with rollout.stream_chunk=2 equals the recording of the
    synchronous loop (tests/golden/tiny_3_steps.json): metrics, archive rows and every checkpoint array."""
    import dataclasses
    import json
    import pathlib

    from helpers import assert_equals_golden, golden_view
    from posttrain.config import from_config_dict
    from posttrain.recipes import grpo
    from posttrain.config.plan import make_run_plan
    from posttrain.recipes.trainer import load_config_file

    root = pathlib.Path(__file__).resolve().parents[3]
    cfg = from_config_dict(load_config_file(root / "configs/tiny.py"))
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, stream_chunk=2),
                              sampling=dataclasses.replace(cfg.sampling, backend="dense"))  # what was recorded
    plan = make_run_plan(cfg, workdir=str(tmp_path))
    assert plan.config.rollout.stream_chunk == 2
    grpo.train(plan, progress=False)
    assert_equals_golden(golden_view(tmp_path), json.loads((root / "tests/golden/tiny_3_steps.json").read_text()))
