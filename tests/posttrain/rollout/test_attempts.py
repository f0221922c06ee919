"""The job scheduler wired into the rollout phase (issue 23 acceptance 2), on a tiny-model run of a seeded flaky env:
30% of the sample attempts of two domains end in infra_error, 100% of a third. Every group of every batch has
all G samples scored, no infra error is scored, the archive has exactly one row per attempt, the quarantine lists
exactly the tasks that failed every try, the broken domain is paused and the run goes on with the others. The
replies are scripted from the sampling key (the tiny model trains on them; its sampler would compile once per
batch shape, and retries make many). Plus `StepDraw` alone: retry tickets of fewer samples run as their own
batch after their back-off."""
import collections
import json
import pathlib
import random

import gymnasium
import jax
import numpy as np
import pytest

from envs import base
from helpers import assert_equals_golden, golden_view, scripted_output, tiny_config
from posttrain.config import from_config_dict, to_dict
from posttrain.recipes import grpo
from posttrain.rollout.episodes import Sample
from posttrain.rollout.rollouter import Rollouter
from posttrain.rollout.attempts import StepDraw, archive_rows
from posttrain.scheduling import archive, status_table
from posttrain.scheduling.scheduler import JobScheduler
from posttrain.scheduling.domain_rules import SchedulerSettings

G, P, STEPS, MAX_ATTEMPTS = 4, 4, 8, 2
INFRA = {"flaky_a": 0.3, "flaky_b": 0.3, "broken": 1.0}


class FlakyEnv(base.TextEnv):
    """A test double: 8 tasks; in training (a reset seed given) an attempt ends in infra_error with probability
    `infra`, else scores 1 or 0 by a coin, both decided by (tag, task, reset seed, reply); its self-check (no seed)
    scores replies that start with a digit."""

    def __init__(self, infra=0.0, tag="x", self_check=True):
        self.infra, self.tag, self.seed = float(infra), tag, None
        tasks = base.ListTaskSource([{"id": f"{tag}{i}", "q": f"Say a digit ({tag} {i})"} for i in range(8)],
                                    split="train")
        super().__init__(tasks, max_turns=1, self_check=self_check)

    def reset(self, *, seed=None, options=None):
        self.seed = seed
        return super().reset(seed=seed, options=options)

    def first_observation(self, task):
        return task["q"]

    def turn_step(self, action):
        if self.seed is None:
            ok = action[:1].isdigit()
        else:
            coin = random.Random(f"{self.tag}:{self.task['id']}:{self.seed}:{action}")
            if coin.random() < self.infra:
                return "", 0.0, True, {"status": "infra_error", "reason": "flaky sandbox", "cost": 0.01}
            ok = coin.random() < 0.5
        return "", float(ok), True, {"status": "ok" if ok else "wrong", "cost": 0.01}

    def golden_episodes(self):
        task = self.task_source.get_task(0)
        return [(task, ["7"], 1.0), (task, ["x"], 0.0)]


if "test/Flaky-v0" not in gymnasium.registry:
    gymnasium.register("test/Flaky-v0", entry_point=FlakyEnv)


def flaky_config(workdir, **over):
    raw = to_dict(tiny_config(workdir, **{"train.steps": STEPS, "checkpoint.every_steps": STEPS,
                                          "rl.max_resample_rounds": 4, **over}))
    raw["env"]["train"] = {d: {"id": "test/Flaky-v0", "weight": 1.0, "kwargs": {"infra": p, "tag": d}}
                           for d, p in INFRA.items()}
    raw["tasks"].update(enabled=True, backoff_s=0.0, retries_per_step=1, max_attempts=MAX_ATTEMPTS,
                        breaker_window=12, breaker_rate=0.75, breaker_cooldown_steps=2)
    return from_config_dict(raw)


def scripted_sample_fn(rollouter, policy, params):
    """The rollouter's sampler replaced by 1-5 random printable bytes per row (then EOS), drawn from the
    sampling key and the row: deterministic, different across samples, calls and steps; logprob -1 per token."""
    tok, Lg = rollouter.tokenizer, params.max_new_tokens

    def fn(prompts, lengths, key, group_size):
        rng = random.Random(str(np.asarray(jax.random.key_data(key)).tolist()))
        rows = [tok.encode("".join(rng.choice("0123456789abcdefxyz ") for _ in range(rng.randint(1, 5))))
                + [tok.eos_id] for _ in range(len(prompts) * group_size)]
        return scripted_output(rows, tok.pad_id, Lg, -1.0)

    return fn


@pytest.fixture(scope="module")
def flaky_run(tmp_path_factory):
    """The 8-step run: summary, metrics rows, archive rows, the last checkpoint's scheduler state, its golden view
    and workdir/status.json as read back after each of the loop's writes (`status_table.write_status`)."""
    workdir, statuses = tmp_path_factory.mktemp("flaky"), []

    def write_status(wd, status, _write=status_table.write_status):
        path = _write(wd, status)
        statuses.append(status_table.read_status(wd))
        return path

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Rollouter, "sample_fn", scripted_sample_fn)
        mp.setattr(status_table, "write_status", write_status)
        summary = grpo.train(flaky_config(workdir), progress=False)
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    meta = json.loads((workdir / "checkpoints" / str(STEPS) / "meta" / "metadata").read_text())
    assert status_table.read_status(workdir) == statuses[-1]
    return (summary, metrics, archive.read(workdir).to_pylist(), meta["scheduler"], golden_view(workdir),
            statuses)


def test_the_run_continues_and_every_batch_group_is_fully_scored(flaky_run):
    summary, metrics, rows, _, _, _ = flaky_run
    assert summary["end_step"] == STEPS and [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["env/infra_error_rate"] == 0.0 for m in metrics)  # no infra error in any batch
    for step in range(STEPS):
        batch = collections.defaultdict(list)
        for r in rows:
            if r["step"] == step and r["in_batch"]:
                batch[r["episode_id"].rsplit(":", 1)[0]].append(r)
        assert len(batch) == P, step  # dropped groups were replaced by fresh draws
        for group in batch.values():
            assert sorted(r["sample"] for r in group) == list(range(G))
            assert all(r["status"] != "infra_error" and r["reward"] in (0.0, 1.0) for r in group)
    infra = [r for r in rows if r["status"] == "infra_error"]
    assert infra and all(r["reward"] is None and not r["in_batch"] for r in infra)  # never scored, never trained
    flaky = [r for r in rows if r["domain"] != "broken"]
    assert 0.15 < sum(r["status"] == "infra_error" for r in flaky) / len(flaky) < 0.45
    assert max(r["retry_round"] for r in rows) == 1 and any(m["tasks/retries"] > 0 for m in metrics)


def test_the_job_scheduler_run_reproduces_the_synchronous_loop(flaky_run):
    """Issue 24 acceptance 1: at rollout.max_staleness=0 the rollout queue (a producer thread) reproduces the
    synchronous loop exactly: metrics.jsonl (timings aside), the archive row for row and the final checkpoint
    equal tests/golden/flaky_8_steps.json, recorded from the loop before the queue (retries, re-queues, quarantine
    and a paused domain all happen in it)."""
    golden = json.loads((pathlib.Path(__file__).resolve().parents[2] / "golden" / "flaky_8_steps.json").read_text())
    view = flaky_run[4]
    assert view["final_step"] == STEPS and view["archive_rows"] == golden["archive_rows"] > STEPS * P * G
    assert_equals_golden(view, golden)


def test_the_archive_has_one_row_per_attempt(flaky_run):
    _, metrics, rows, state, _, _ = flaky_run
    keys = [(r["episode_id"], r["attempt"]) for r in rows]
    assert len(set(keys)) == len(keys)
    assert len(rows) == sum(d["totals"]["episodes"] for d in state["domains"].values())  # every reported run
    assert len(rows) == sum(m[f"tasks/{d}/episodes"] for m in metrics[-1:] for d in INFRA)
    visits, trained = collections.defaultdict(set), collections.Counter()
    for r in rows:
        visits[r["episode_id"].rsplit(":", 1)[0]].add(r["attempt"])
        trained[r["episode_id"]] += r["in_batch"]
    assert all(got == set(range(len(got))) for got in visits.values())  # a visit's tickets number its attempts
    assert max(trained.values()) == 1  # a sample enters one batch at most, with one of its attempts


def test_quarantine_is_exactly_the_tasks_that_failed_every_try(flaky_run):
    _, _, rows, state, _, _ = flaky_run
    failed = collections.defaultdict(set)  # (domain, task, visit) -> its tries that left the batch (no probe)
    trained = {(r["domain"], r["task_index"], r["visit"], r["try_index"]) for r in rows if r["in_batch"]}
    for r in rows:
        visit = (r["domain"], r["task_index"], r["visit"])
        if (*visit, r["try_index"]) not in trained and not json.loads(r["details"])["probe"]:
            failed[visit].add(r["try_index"])
    expected = collections.defaultdict(list)
    for (d, task, _), tries in sorted(failed.items()):
        if len(tries) == MAX_ATTEMPTS:
            expected[d].append(task)
    got = {d: s["quarantine"] for d, s in state["domains"].items() if s["quarantine"]}
    assert got == dict(expected) and got  # (the broken domain's tries stop when it is paused; probes cost none)


def test_the_broken_domain_is_paused_and_the_others_fill_the_batches(flaky_run):
    _, metrics, rows, state, _, _ = flaky_run
    assert state["domains"]["broken"]["breaker"]["trips"] >= 1
    assert all(d["breaker"]["state"] == "closed" for n, d in state["domains"].items() if n != "broken")
    paused = [m["step"] - 1 for m in metrics if m["tasks/broken/breaker"] > 0]
    assert paused and all(m["tasks/paused"] == 1.0 for m in metrics if m["step"] - 1 in paused)
    broken = collections.Counter(r["step"] for r in rows if r["domain"] == "broken")
    assert broken[0] > G and {broken[s] for s in range(1, STEPS)} == {0, G}  # paused: now and then a probe group
    assert not any(r["in_batch"] for r in rows if r["domain"] == "broken")


def test_status_json_is_rewritten_every_step_with_the_scheduler_state(flaky_run):
    """Issue 23 item 7: after each step workdir/status.json holds that step, the policy version that sampled its
    batch (here the step: synchronous), each domain's policy, its last-step and run counters (equal to the archive's
    rows), its breaker (paused or not, as the step's tasks/<domain>/breaker metric) and quarantined tasks (as the
    checkpoint's quarantine at the end)."""
    _, metrics, rows, state, _, statuses = flaky_run
    assert [(s["step"], s["steps"], s["policy_version"]) for s in statuses] == [(k, k + 1, k) for k in range(STEPS)]
    codes = {"closed": 0.0, "open": 1.0, "probing": 2.0}
    for k, (status, m) in enumerate(zip(statuses, metrics)):
        assert status["scheduler"] == "jobs" and sorted(status["domains"]) == sorted(INFRA)
        for d, s in status["domains"].items():
            last = [r for r in rows if r["domain"] == d and r["step"] == k]
            run = [r for r in rows if r["domain"] == d and r["step"] <= k]
            assert (s["weight"], s["priority"], s["max_env_cpu_s"]) == (1.0, 0, 0.0)
            assert (s["last"]["episodes"], s["run"]["episodes"]) == (len(last), len(run)), (k, d)
            assert s["last"]["infra_errors"] == sum(r["status"] == "infra_error" for r in last)
            assert s["run"]["cpu_s"] == pytest.approx(0.01 * len(run))  # every attempt reports cost 0.01 s
            assert codes[s["breaker"]] == m[f"tasks/{d}/breaker"], (k, d)
        assert sum(s["quarantined"] for s in status["domains"].values()) == m["tasks/quarantined"]
    paused = [k for k, s in enumerate(statuses) if s["domains"]["broken"]["breaker"] != "closed"]
    assert paused and all(s["domains"]["flaky_a"]["breaker"] == "closed" for s in statuses)
    assert {d: s["quarantined"] for d, s in statuses[-1]["domains"].items()} == {
        d: len(s["quarantine"]) for d, s in state["domains"].items()}


def test_retry_tickets_run_as_their_own_batch_after_their_back_off():
    """One group of 3 whose sample 1 fails once: the retry is a ticket of one sample, run after backoff_s in a
    second call of group size 1; the group completes with sample 1's second attempt, in sample order."""

    class Source:
        num_tasks = 1

        def get_task(self, i):
            return {"id": f"t{i}"}

    sched = JobScheduler({"d": Source()}, SchedulerSettings(group_size=3, backoff_s=0.25, run="r"))
    calls, slept = [], []

    def run_fn(batch, size, call):
        calls.append((len(batch), size, call))
        fail = call == 0
        return [Sample(domain="d", group=0, prompt_ids=[1], texts=[f"{call}:{k}"], reward=float(k % 2),
                       status="infra_error" if fail and k == 1 else "ok") for t in batch for k in t.samples], {}

    d = StepDraw(3, dynamic_sampling=False)
    d.round(run_fn, sched.next_tasks(0, 1), sched, sleep=slept.append)
    assert calls == [(1, 3, 0), (1, 1, 1)] and slept == [0.25]
    samples, _, attempts = d.finish(1, 1)
    assert [s.texts for s in samples] == [["0:0"], ["1:1"], ["0:2"]]
    tok = type("Tok", (), {"decode": staticmethod(lambda ids, skip_special_tokens=True: str(ids))})
    rows = archive_rows(attempts, tok, policy_version=0)
    assert [(r["episode_id"], r["attempt"], r["in_batch"], r["reward"]) for r in rows] == [
        ("r:d:0:0:0", 0, True, 0.0), ("r:d:0:0:1", 0, False, None), ("r:d:0:0:2", 0, True, 0.0),
        ("r:d:0:0:1", 1, True, 1.0)]
