"""Gaming floors and sampled golden checks of a domain, through the domain's own environment and scorer.

A **floor** is the best mean reward a reply without a solution earns: a policy can learn it instead of the task.
A **golden sample** checks that sampled reference replies of every split score 1. The method: docs/tasks.md.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from envs.tasks import reasoning_gym
from envs.verify import answers

RG_PREFIX = "reasoning_gym/"
GOLDEN_SAMPLE_STATUSES = ("passed", "failed", "unverified", "skipped")
CONSTANTS = ("yes", "no", "Yes", "No", "True", "False", "0", "1", "2", "-1", "None", "[]")
TOP_GOLD = 3  # the most frequent gold answers of the train sample tried as constants
MAX_CANDIDATES = 20  # distinct gold answers in the candidate-list probe
MIN_TASKS = 3  # tasks per split sampled however slow the dataset's generation


@dataclasses.dataclass(frozen=True)
class EnvDomain:
    """A registry domain over a posttrain env other than ReasoningGym-v0.

    Attributes:
      env_id: the gymnasium id (`envs.ENTRY_POINTS`); kwargs: its default constructor kwargs besides split.
      splits: the env's splits; a domain with one split has a single task set.
      wrap: format string putting an answer where the scorer reads it ("#### {}"); "" when answers aren't constants.
      probes: replies tried as they are, besides the empty reply.
      reference: how a task's reference reply is made: "golden_answer", "canonical_solution" (the task's field),
        "golden_episodes" or "module:function" returning (status, source, reason, sample).
      tasks: at most this many tasks per split probed.
    """

    env_id: str
    kwargs: Mapping[str, Any]
    splits: tuple[str, ...]
    wrap: str
    probes: tuple[str, ...]
    reference: str
    tasks: int = 20


CODE_STUBS = ("    pass\n", "    return None\n", "    return 0\n", "    return []\n", "    return ''\n",
              "    return True\n", "    return False\n")
ENV_DOMAINS: dict[str, EnvDomain] = {
    "arithmetic": EnvDomain("posttrain/Arithmetic-v0", {"digits": 2}, ("train", "test"), "#### {}",
                            ("The answer is 0.",), "golden_answer"),
    "gsm8k": EnvDomain("posttrain/GSM8K-v0", {"path": "../shared/data/gsm8k"}, ("train", "test"), "#### {}",
                       (), "golden_answer"),
    "humaneval": EnvDomain("posttrain/HumanEval-v0", {}, ("test",), "", CODE_STUBS, "canonical_solution", 10),
    "python_tool": EnvDomain("posttrain/PythonTool-v0", {}, ("train", "test"), "\\boxed{{{}}}", ("\\boxed{}",),
                             "golden_answer", 10),
    "terminal": EnvDomain("posttrain/Terminal-v0", {}, ("test",), "", ("DONE", "```bash\nls\n```\nDONE"),
                          "golden_episodes", 10),
    "agentic/repo_fix": EnvDomain("posttrain/RepoFix-v0", {}, ("train", "test"), "",
                                  ("<tool_call>{\"name\": \"submit\", \"arguments\": {}}</tool_call>",),
                                  "envs.tasks.repo_fix.env:golden_status", 2),
    "long_context/doc_analysis": EnvDomain("posttrain/DocAnalysis-v0", {"target_tokens": 1024}, ("train", "test"),
                                           "<answer>{}</answer>", (), "golden_answer"),
    "long_context/synthetic": EnvDomain("posttrain/LongSynthetic-v0", {"target_tokens": 1024}, ("train", "test"),
                                        "<answer>{}</answer>", (), "golden_answer"),
    "long_context/codebase": EnvDomain("posttrain/CodebaseQA-v0", {"target_tokens": 1024}, ("train", "test"),
                                       "<answer>{}</answer>", (), "golden_answer"),
}


@dataclasses.dataclass(frozen=True)
class Assessment:
    """One domain's floor and golden sample: a row of the `posttrain domains --floors` table.

    Attributes:
      config: the dataset config / env kwargs assessed, as sorted JSON.
      floor, probe: the best probe's held-out mean reward in [0, 1] and its name (None, "" when skipped).
      probes: {probe name: mean reward} of every probe.
      golden: a GOLDEN_SAMPLE_STATUSES value; golden_checked / golden_failures: reference replies scored / below 1.
      reason: why golden is not "passed" (the first failures, or why skipped).
      num_tasks: {split: tasks in the split} (None for a procedural reasoning-gym split).
      sampled: the tasks the probes were scored on (fewer than asked for a dataset slow to generate).
    """

    domain: str
    config: str
    floor: float | None
    probe: str
    probes: Mapping[str, float]
    golden: str
    golden_checked: int
    golden_failures: int
    reason: str
    num_tasks: Mapping[str, int | None]
    sampled: int = 0


def probe_replies(tasks_train: list[dict], wrap: str, extra: tuple[str, ...] = (),
                  gold: Callable[[dict], str | None] = lambda t: t.get("answer")) -> dict[str, Callable[[dict], str]]:
    """{probe name: task -> reply} of replies without a solution, constants from the gold answers of `tasks_train`.

    `wrap` formats an answer ("" skips the answer probes); `extra` replies are used as they are."""
    probes: dict[str, Callable[[dict], str]] = {"empty": lambda t: ""}
    for reply in extra:
        probes[f"reply:{reply.strip()[:40]}"] = lambda t, r=reply: r
    if not wrap:
        return probes
    golds = [str(g).strip() for g in map(gold, tasks_train) if g is not None and str(g).strip()]
    constants = [g for g, _ in collections.Counter(golds).most_common(TOP_GOLD)] + list(CONSTANTS)
    probes["format_only"] = lambda t: wrap.format("")
    for value in dict.fromkeys(constants):
        probes[f"constant:{value[:40]}"] = lambda t, v=value: wrap.format(v)
    candidates = list(dict.fromkeys(golds))[:MAX_CANDIDATES]
    if len(candidates) > 1:
        probes["candidates"] = lambda t: wrap.format(", ".join(candidates))
    probes["question"] = lambda t: wrap.format(t["question"])
    probes["question_raw"] = lambda t: t["question"]
    return probes


def floor_of(score: Callable[[dict, str], float], tasks: list[dict], probes: Mapping[str, Callable[[dict], str]],
             select_on: list[dict] | None = None,
             select_score: Callable[[dict, str], float] | None = None) -> tuple[float, str, dict[str, float]]:
    """(floor, best probe, {probe: mean reward on `tasks`}) of `probes` scored by `score(task, reply)`.

    The best probe is chosen on `select_on` (scored by `select_score`) when given, so its mean on the held-out
    `tasks` is free of the bias of a maximum over noisy means. Raises ValueError for no tasks or no probes."""
    if not tasks or not probes:
        raise ValueError(f"floor_of needs tasks and probes, got {len(tasks)} tasks and {len(probes)} probes")

    def means_on(sample, fn):
        return {name: sum(float(fn(t, make(t))) for t in sample) / len(sample) for name, make in probes.items()}

    means = means_on(tasks, score)
    chosen = means_on(select_on, select_score or score) if select_on else means
    best = max(chosen, key=lambda name: chosen[name])
    return means[best], best, means


def golden_sample(score: Callable[[dict, str], float], tasks: list[dict],
                  reference: Callable[[dict], str | None]) -> tuple[str, int, int, str]:
    """(status, checked, failures, reason) of the reference replies of `tasks`; the reason names three failures."""
    checked, failed = 0, []
    for task in tasks:
        reply = reference(task)
        if reply is None:
            continue
        checked += 1
        got = float(score(task, reply))
        if got != 1.0:
            failed.append(f"{task.get('id', '?')} scored {got:g}")
    if not checked:
        return "unverified", 0, 0, "no reference reply"
    reason = f"{len(failed)}/{checked} reference replies below 1: " + "; ".join(failed[:3]) if failed else ""
    return ("failed" if failed else "passed"), checked, len(failed), reason


def _rg_score(env: reasoning_gym.ReasoningGymEnv) -> Callable[[dict, str], float]:
    return lambda task, reply: env.score(task, reply)[0]


def _rg_reference(task: dict) -> str | None:
    good, _ = reasoning_gym.reference_reply(task)
    return None if good is None else f"<answer>\n{good}\n</answer>"


def _sample_tasks(source, tasks: int, budget_s: float | None) -> list[dict]:
    """The first `tasks` tasks of `source`, or as many as its generation allows within `budget_s` seconds (at least
    `MIN_TASKS`: a few datasets take seconds per item); exactly `tasks` (as many as there are) when `budget_s` is
    None, so a stored assessment is reproduced task for task."""
    start, out = time.perf_counter(), []
    if budget_s is None:
        return [source.get_task(i) for i in range(min(tasks, source.num_tasks))]
    for i in range(min(tasks, source.num_tasks)):
        if len(out) >= MIN_TASKS and time.perf_counter() - start > budget_s:
            break
        out.append(source.get_task(i))
    return out


def assess_reasoning_gym(domain: str, config: Mapping[str, Any] | None = None, *, tasks: int = 20,
                         seed: int = 0, level: int | None = None, budget_s: float | None = 20.0) -> Assessment:
    """The floor and golden sample (both splits) of a reasoning-gym domain with `config` (None: library defaults).

    `tasks` per split; fewer for a split slower than `budget_s` seconds (None: exactly `tasks`, what reproduces a
    stored row). Raises ValueError on a bad dataset/config."""
    dataset = domain.removeprefix(RG_PREFIX)
    cfg = reasoning_gym.parse_config(config, dataset)
    envs_by_split = {split: reasoning_gym.ReasoningGymEnv(dataset=dataset, config=cfg, split=split, seed=seed,
                                                   size=max(tasks, 1), num_test=tasks, level=level,
                                                   self_check=False) for split in ("train", "test")}
    sampled = {s: _sample_tasks(e.task_source, tasks, budget_s) for s, e in envs_by_split.items()}
    n = min(len(v) for v in sampled.values())  # both splits at the count the slower one reached: the row's `sampled`
    sampled = {s: v[:n] for s, v in sampled.items()}
    floor, probe, means = floor_of(_rg_score(envs_by_split["test"]), sampled["test"],
                                   probe_replies(sampled["train"], "<answer>{}</answer>"), select_on=sampled["train"],
                                   select_score=_rg_score(envs_by_split["train"]))
    results = {split: golden_sample(_rg_score(env), sampled[split], _rg_reference)
               for split, env in envs_by_split.items()}
    checked, failures = sum(r[1] for r in results.values()), sum(r[2] for r in results.values())
    failed = [f"{split}: {r[3]}" for split, r in results.items() if r[0] == "failed"]
    status = "failed" if failed else "passed" if checked else "unverified"
    reason = "; ".join(failed) if failed else "" if checked else "no reference answer and no library-provided reply"
    return Assessment(domain, json.dumps(cfg, sort_keys=True, default=str), floor, probe, means, status, checked,
                      failures, reason, {"train": None, "test": None}, len(sampled["test"]))


def assess_env_domain(domain: str, *, tasks: int | None = None) -> Assessment:
    """The floor and golden sample of an `ENV_DOMAINS` domain with its default kwargs.

    An OSError, ImportError or RuntimeError building the envs gives a "skipped" row; other errors propagate."""
    import gymnasium

    import envs  # noqa: F401  (registers the ids)

    d = ENV_DOMAINS[domain]
    n = d.tasks if tasks is None else min(tasks, d.tasks)
    config = json.dumps(dict(d.kwargs), sort_keys=True)
    try:
        built = {s: gymnasium.make(d.env_id, **d.kwargs, **({"split": s} if len(d.splits) > 1 else {})).unwrapped
                 for s in d.splits}
    except (OSError, ImportError, RuntimeError) as exc:
        return Assessment(domain, config, None, "", {}, "skipped", 0, 0, f"{type(exc).__name__}: "
                          + " ".join(str(exc).split())[:200], {})
    try:
        counts = {s: e.task_source.num_tasks for s, e in built.items()}
        sampled = {s: [e.task_source.get_task(i) for i in range(min(n, counts[s]))] for s, e in built.items()}
        test = built[d.splits[-1]]
        gold = (lambda t: answers.gold_answer(t["answer"])) if d.wrap else (lambda t: None)
        probes = probe_replies(sampled[d.splits[0]], d.wrap, d.probes, gold=gold)
        first = built[d.splits[0]]
        floor, probe, means = floor_of(lambda t, r: test.play(t, [r])[0], sampled[d.splits[-1]], probes,
                                       select_on=sampled[d.splits[0]] if len(d.splits) > 1 else None,
                                       select_score=lambda t, r: first.play(t, [r])[0])
        golden = _env_golden(d, built, sampled)
    finally:
        for env in built.values():
            env.close()
    return Assessment(domain, config, floor, probe, means, *golden, counts, len(sampled[d.splits[-1]]))


def _env_golden(d: EnvDomain, built: Mapping[str, Any], sampled: Mapping[str, list]) -> tuple[str, int, int, str]:
    if ":" in d.reference:
        module, function = d.reference.split(":")
        status, _, reason, _ = getattr(importlib.import_module(module), function)()
        return ("passed" if status == "verified" else "failed"), 1, int(status != "verified"), reason
    status, checked, failures, reasons = "unverified", 0, 0, []
    for split, env in built.items():
        if d.reference == "golden_episodes":
            episodes = [(t, actions) for t, actions, want in env.golden_episodes() if want == 1.0]
            results = [(t, env.play(t, actions)[0]) for t, actions in episodes]
        else:
            make = env.golden_answer if d.reference == "golden_answer" else (lambda t: t["canonical_solution"])
            results = [(t, env.play(t, [make(t)])[0]) for t in sampled[split]]
        checked += len(results)
        bad = [f"{split} {t.get('id', t.get('task_id', '?'))} scored {r:g}" for t, r in results if r != 1.0]
        failures, reasons = failures + len(bad), reasons + bad
    if checked:
        status = "failed" if failures else "passed"
    reason = f"{failures}/{checked} reference replies below 1: " + "; ".join(reasons[:3]) if failures else ""
    return status, checked, failures, reason


TASK_FILE_WRAPS = {"math": "#### {}"}  # where a verifier reads a bare answer; the others read <answer> tags
TASK_FILE_CODE_PROBES = ("```python\npass\n```", "```python\ndef f(*args, **kwargs):\n    return None\n```")


def task_file_probes(rows: list[dict], tasks: int) -> tuple[list[dict], list[dict], dict[str, Callable[[dict], str]]]:
    """(rows the probes are chosen on, rows they are measured on, {probe name: task -> reply}) of a task file's rows.

    Up to `tasks` even rows and `tasks` odd rows, whatever their split; the constants come from the even rows' answers,
    one probe set per answer format the rows' verifiers read (`TASK_FILE_WRAPS`)."""
    train, test = rows[0::2][:tasks], (rows[1::2] or rows[:1])[:tasks]
    names = {s["name"] for t in rows for s in t["verifier"]}
    replies: dict[str, Callable[[dict], str]] = {}
    for wrap in dict.fromkeys(TASK_FILE_WRAPS.get(n, "<answer>{}</answer>") for n in sorted(names)):
        replies.update(probe_replies(train, wrap, TASK_FILE_CODE_PROBES if "code_tests" in names else (),
                                     gold=lambda t: t.get("answer") if isinstance(t.get("answer"), str) else None))
    return train, test, replies


def assess_task_file(kwargs: Mapping[str, Any], *, tasks: int = 100) -> Assessment:
    """The floor and golden sample of a task file (`envs.tasks.task_file`), through the same prober as the registry.

    Probes are chosen on up to `tasks` of the even rows and measured on up to `tasks` of the odd rows, whatever
    their split (a file of few test rows still gets a floor over its rows); every sampled row's reference reply is
    golden-checked. Raises what reading the file raises (FileNotFoundError, TaskFileError)."""
    from envs.tasks import task_file

    settings = task_file.TaskFileSettings(**{**dict(kwargs), "split": "all"})
    rows, _ = task_file.scan(settings)
    if not rows:
        raise task_file.TaskFileError(f"{settings.path}: no readable rows")
    # a floor is a property of the rows, whatever their split: probes chosen on the even rows, measured on the odd
    train, test, replies = task_file_probes(rows, tasks)
    score = lambda t, r: task_file.score_task(t, r)[0]
    floor, probe, means = floor_of(score, test, replies, select_on=train)
    golden = golden_sample(score, train + test, task_file.golden_reply)
    config = json.dumps({k: v for k, v in dict(kwargs).items()}, sort_keys=True, default=str)
    counts = {s: sum(t["split"] == s for t in rows) for s in ("train", "test")}
    return Assessment(settings.path, config, floor, probe, means, *golden, counts, len(test))
