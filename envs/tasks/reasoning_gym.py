"""ReasoningGym-v0: one gymnasium text env over any `reasoning-gym` dataset (arXiv:2505.24760, ~106 domains).

Each dataset's own ``score_answer`` (partial credit included) scores the ``<answer>`` tag, and its curricula set
levels. Train and test questions are disjoint (`held_out`), so a small task space cannot leak eval questions.
Tasks carry the dataset's whole entry, so any worker can score them whatever its kwargs. No JAX.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import sys
import zlib
from collections.abc import Mapping
from typing import Any

from envs import base

from envs.verify import answers
from envs.verify import tagged
ENV_ID = "posttrain/ReasoningGym-v0"
INSTRUCTION = ("\n\nThink it through, then give only the final answer inside <answer></answer> tags, "
               "in the format the question asks for (it may span several lines).")
# For small instruct models: SmolLM2-135M echoes the long instruction's words ("in the format the question asks
# for", empty "<answer></answer>") instead of answering; this one keeps the convention in a few words.
SHORT_INSTRUCTION = "\n\nGive only the final answer inside <answer></answer> tags."
TEST_SEED_OFFSET = 1_000_003  # test split seed = train seed + this (a different procedural stream)
# datasets whose items depend on str hashing (the library iterates sets of str): the same only under one
# PYTHONHASHSEED (the `posttrain` command fixes it); and one whose items vary even then (measured, library 0.1.25)
HASH_DEPENDENT = ("isomorphic_strings", "knight_swap", "polynomial_multiplication", "ransom_note", "word_ladder")
NONDETERMINISTIC = ("list_functions",)
HELD_OUT_BUCKETS = 8  # a question is held out (test split only) when crc32(question) % this == 0
MAX_DRAWS = 256  # draws per task before a split gives up: (7/8)**256 ~ 1e-15 for a test task of a large space
# Metadata fields in which reasoning-gym ships a reply its own scorer accepts, for datasets without a reference
# answer (graph_color, propositional_logic, rubiks_cube); datasets with neither are "unverified".
REFERENCE_REPLY_KEYS = ("possible_answer", "example_answer", "example_correct_answer")
# Datasets whose library defaults do not build: the default config used for them here.
DEFAULT_CONFIGS = {"composite": {"datasets": [{"name": "chain_sum", "weight": 1.0, "config": {}},
                                              {"name": "basic_arithmetic", "weight": 1.0, "config": {}}]}}
GOLDEN_STATUSES = ("verified", "verified_reference_free", "unverified", "failed")


def library():
    """The `reasoning_gym` module. Raises ImportError with the install command when it is missing."""
    try:
        import reasoning_gym
        import reasoning_gym.utils  # noqa: F401
    except ImportError as exc:
        raise ImportError("ReasoningGym-v0 needs the reasoning-gym package: pip install 'reasoning-gym>=0.1.25'"
                          ) from exc
    return reasoning_gym


def library_output_to_stderr():
    """A context sending what the library prints to stderr, so generators that print (bf) cannot corrupt stdout."""
    return contextlib.redirect_stdout(sys.stderr)


def containment_credit(answer: str, gold: str, value: float) -> float:
    """Partial credit `value` for an answer containing the gold text, kept only when the rest is punctuation.

    Else 0 (reasoning-gym pays len(gold) / len(answer) to a list of candidates); unchanged when the gold is absent."""
    if gold not in answer:
        return value
    rest = answer.replace(gold, "", 1)
    return value if not any(ch.isalnum() for ch in rest) else 0.0


def dataset_names() -> list[str]:
    """Sorted names of every dataset registered in reasoning-gym (``reasoning_gym.factory.DATASETS``)."""
    return sorted(library().factory.DATASETS)


def parse_config(config: Mapping[str, Any] | str | None, dataset: str = "?") -> dict:
    """A dataset config as a dict: None -> {}, a JSON object string (env kwargs) -> its dict, a mapping -> a copy.

    Raises ValueError on bad JSON or a JSON value that is not an object, TypeError on any other type."""
    if config is None:
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config) if config.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"reasoning_gym/{dataset}: config is not valid JSON: {exc}") from None
    if not isinstance(config, Mapping):
        raise TypeError(f"reasoning_gym/{dataset}: config must be a mapping or a JSON object string, "
                        f"got {type(config).__name__}")
    return dict(config)


def max_level(dataset: str) -> int | None:
    """Highest curriculum level of `dataset` (levels 0..max over its attributes), None without a curriculum."""
    factory = library().factory
    if not factory.has_curriculum(dataset):
        return None
    attrs = factory.create_curriculum(dataset).attributes.values()
    return max((len(a.levels) - 1 for a in attrs), default=0)


_WARNED: set[str] = set()


def warn_unstable(dataset: str) -> None:
    """Warns once per dataset whose tasks another process would not rebuild.

    A `HASH_DEPENDENT` one when PYTHONHASHSEED is not set (the `posttrain` command sets it; a notebook or script of
    one's own may not), and a `NONDETERMINISTIC` one always."""
    import os
    import warnings

    if dataset in _WARNED:
        return
    if dataset in HASH_DEPENDENT and "PYTHONHASHSEED" not in os.environ:
        warnings.warn(f"reasoning_gym/{dataset}: its tasks depend on str hashing, so another process (a resumed run, "
                      "an env worker) builds other tasks at the same index; set PYTHONHASHSEED (e.g. 0) before "
                      "Python starts, as the posttrain command does", RuntimeWarning, stacklevel=3)
        _WARNED.add(dataset)
    elif dataset in NONDETERMINISTIC:
        warnings.warn(f"reasoning_gym/{dataset}: the library builds its items differently on each build (measured "
                      "on 0.1.25), so its tasks are not reproducible across processes", RuntimeWarning, stacklevel=3)
        _WARNED.add(dataset)


def build_dataset(dataset: str, config: Mapping[str, Any] | str | None = None, *, seed: int = 0, size: int = 1000,
                  level: int | None = None):
    """A reasoning-gym ``ProceduralDataset`` for `dataset` with `config`, `seed`, `size`.

    `level` applies the library's curriculum, whose attributes override those keys of `config`. Raises ValueError
    on an unknown dataset, bad config keys (seed/size included) or values, or a level outside [0, max_level];
    TypeError on a config of the wrong type."""
    rg = library()
    datasets = rg.factory.DATASETS
    warn_unstable(dataset)
    if dataset not in datasets:
        close = difflib.get_close_matches(str(dataset), datasets, n=3)
        raise ValueError(f"reasoning_gym: unknown dataset {dataset!r}" + (f"; did you mean {close}?" if close else
                         f"; {len(datasets)} known, e.g. {sorted(datasets)[:5]}"))
    dataset_cls, config_cls = datasets[dataset]
    cfg = {**DEFAULT_CONFIGS.get(dataset, {}), **parse_config(config, dataset)}
    for key in ("seed", "size"):
        if key in cfg:
            raise ValueError(f"reasoning_gym/{dataset}: config key {key!r} is set by the env kwarg {key}=, "
                             f"not inside config")
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(cfg) - fields)
    if unknown:
        raise ValueError(f"reasoning_gym/{dataset}: unknown config key(s) {unknown}; valid: {sorted(fields - {'seed', 'size'})}")
    if dataset == "composite":
        from reasoning_gym.composite import DatasetSpec

        cfg["datasets"] = [d if isinstance(d, DatasetSpec) else DatasetSpec(**dict(d)) for d in cfg["datasets"]]
    cfg.update(seed=int(seed), size=int(size))
    try:
        if level is None:
            config_obj = config_cls(**cfg)
        else:
            top = max_level(dataset)
            if top is None:
                raise ValueError(f"reasoning_gym/{dataset}: level={level!r} given but the dataset has no curriculum")
            if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= top:
                raise ValueError(f"reasoning_gym/{dataset}: level must be an int in [0, {top}], got {level!r}")
            curriculum = rg.factory.create_curriculum(dataset)
            curriculum.set_global_level(level)
            config_obj = curriculum.generate_configuration(defaults=cfg)
        with library_output_to_stderr():
            return dataset_cls(config=config_obj)
    except (AssertionError, TypeError, ValueError, KeyError) as exc:
        if isinstance(exc, ValueError) and str(exc).startswith(f"reasoning_gym/{dataset}"):
            raise
        raise ValueError(f"reasoning_gym/{dataset}: invalid config {cfg}: {type(exc).__name__}: {exc}") from None


def held_out(question: str) -> bool:
    """Whether `question` is on the held-out (test) side: ``crc32(question) % HELD_OUT_BUCKETS == 0``.

    Stable across processes and versions (unlike ``hash``); train tasks never have it, test tasks always."""
    return zlib.crc32(question.encode("utf-8", "surrogatepass")) % HELD_OUT_BUCKETS == 0


def reference_reply(entry: Mapping[str, Any]) -> tuple[str | None, str]:
    """(a reply the dataset's scorer should accept, its source): "answer", a `REFERENCE_REPLY_KEYS` field, or none."""
    if entry.get("answer") is not None:
        return str(entry["answer"]), "answer"
    meta = entry.get("metadata") or {}
    for key in REFERENCE_REPLY_KEYS:
        if meta.get(key) is not None:
            value = meta[key]
            return (value if isinstance(value, str) else json.dumps(value)), f"metadata.{key}"
    return None, "none"


class ReasoningGymTasks:
    """`TaskSource` over one reasoning-gym dataset and split (arguments as in `build_dataset`).

    The "train" split is built with seed `seed` and `size` items, "test" with `seed + TEST_SEED_OFFSET` and
    `num_test` items. Raises ValueError on bad arguments, IndexError on a bad index."""

    def __init__(self, dataset: str, config: Mapping[str, Any] | str | None = None, *, split: str = "train",
                 seed: int = 0, size: int = 1000, num_test: int = 100, level: int | None = None) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"reasoning_gym/{dataset}: split must be 'train' or 'test', got {split!r}")
        for key, value in (("size", size), ("num_test", num_test), ("seed", seed)):
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "seed" else 1):
                raise ValueError(f"reasoning_gym/{dataset}: {key} must be an int >= {0 if key == 'seed' else 1}, "
                                 f"got {value!r}")
        self.name, self.split, self.level = dataset, split, level
        n, s = (size, seed) if split == "train" else (num_test, seed + TEST_SEED_OFFSET)
        self.dataset = build_dataset(dataset, config, seed=s, size=n, level=level)
        self._num_tasks = n
        self._cache: dict[int, dict] = {}  # generation is deterministic per index; some items take ~1 s
        if split == "test":
            self.get_task(0)  # a task space with no held-out question fails here, not in the middle of a run

    @property
    def num_tasks(self) -> int:
        return self._num_tasks

    def get_task(self, index: int) -> dict:
        base.check_index(index, self.num_tasks, f"reasoning_gym/{self.name}")
        if index not in self._cache:
            if len(self._cache) >= 64:
                self._cache.clear()
            self._cache[index] = self._make_task(index)
        return dict(self._cache[index])

    def _entry(self, index: int) -> dict:
        """The library entry of task `index`: draw ``index + k * num_tasks`` for k = 0, 1, ... (modulo the size
        for datasets with a fixed item list) until `held_out(question)` matches the split."""
        n, want = self._num_tasks, self.split == "test"
        for k in range(MAX_DRAWS):
            try:
                with library_output_to_stderr():
                    entry = self.dataset[index + k * n]
            except IndexError:  # a fixed item list (gsm_symbolic, list_functions, word_ladder): wrap around
                with library_output_to_stderr():
                    entry = self.dataset[(index + k) % n]
            if held_out(entry["question"]) == want:
                return entry
        raise ValueError(f"reasoning_gym/{self.name}: no {self.split} question in {MAX_DRAWS} draws for task "
                         f"{index} (a task space this small cannot be split into train and held-out questions)")

    def _make_task(self, index: int) -> dict:
        entry = self._entry(index)
        answer = entry.get("answer")
        return {"id": f"reasoning_gym/{self.name}-{self.split}-{index}", "dataset": self.name,
                "question": entry["question"], "answer": None if answer is None else str(answer),
                "metadata": entry.get("metadata", {}), "level": self.level}


@dataclasses.dataclass(frozen=True)
class GoldenResult:
    """Outcome of `ReasoningGymEnv.golden_check`: a GOLDEN_STATUSES status, the reply's source and a reason."""

    status: str
    source: str
    reason: str = ""


class ReasoningGymEnv(base.TextEnv):
    """posttrain/ReasoningGym-v0: single-turn; reward = the dataset's ``score_answer`` of the tagged answer.

    Kwargs: those of `ReasoningGymTasks`, ``allow_unverified`` (accept a dataset with no reference reply),
    ``fallback`` (False: tags only) and ``instruction`` (None: `INSTRUCTION`; `SHORT_INSTRUCTION` suits small
    models). ``info["status"]`` is "ok" only at score 1; a scorer exception scores 0 with the reason."""

    think_tags = answers.THINK_TAGS

    def __init__(self, *, dataset: str | None = None, config: Mapping[str, Any] | str | None = None,
                 split: str = "train", seed: int = 0, size: int = 1000, num_test: int = 100,
                 level: int | None = None, self_check: bool = True, allow_unverified: bool = False,
                 fallback: bool = True, instruction: str | None = None) -> None:
        if not isinstance(dataset, str) or not dataset:
            raise ValueError(f"{ENV_ID}: kwarg 'dataset' is required (a reasoning-gym dataset name, e.g. "
                             f"'chain_sum'), got {dataset!r}")
        self.allow_unverified, self.fallback = allow_unverified, bool(fallback)
        if instruction is not None and not isinstance(instruction, str):
            raise ValueError(f"{ENV_ID}: instruction must be a str or None, got {type(instruction).__name__}")
        self.instruction = INSTRUCTION if instruction is None else instruction
        tasks = ReasoningGymTasks(dataset, config, split=split, seed=seed, size=size, num_test=num_test, level=level)
        super().__init__(tasks, max_turns=1, self_check=self_check)

    def validate_task(self, task: dict) -> dict:
        base.require_keys(task, ("question", "answer", "metadata"), ENV_ID)
        if not isinstance(task["question"], str) or not task["question"].strip():
            raise ValueError(f"{ENV_ID}: task['question'] must be a non-empty str")
        return task

    def first_observation(self, task: dict) -> str:
        return task["question"] + self.instruction

    def score(self, task: Mapping[str, Any], reply: str) -> tuple[float, dict]:
        """(reward in [0, 1], info) of `reply` on `task` through the dataset's own scorer."""
        answer, method = tagged.read_answer(reply, self.think_tags, fallback=self.fallback)
        entry = {"question": task["question"], "answer": task["answer"], "metadata": task["metadata"]}
        try:
            value = float(self.task_source.dataset.score_answer(answer, entry))
            if 0.0 < value < 1.0 and isinstance(answer, str) and isinstance(task["answer"], str):
                value = containment_credit(answer, task["answer"], value)
            reason = ("no <answer>...</answer> after the reasoning block" + (" and no final-answer last line"
                      if self.fallback else "")) if answer is None else ""
        except Exception as exc:  # noqa: BLE001 - a scorer crash on odd text scores 0 with a reason
            value, reason = 0.0, f"scorer error: {type(exc).__name__}: {exc}"[:300]
        if not 0.0 <= value <= 1.0:  # NaN included
            value, reason = 0.0, f"scorer returned {value!r} outside [0, 1]"
        status = "ok" if value == 1.0 else "wrong"
        if status == "wrong" and not reason:
            reason = "partial credit" if value > 0 else "answer scored 0"
        shown = answer if answer is None or len(answer) <= answers.MAX_ANSWER_CHARS else answer[:200] + "..."
        return value, {"status": status, "score": value, "extracted": shown, "gold": task["answer"],
                       "method": method, "reason": reason, "level": task.get("level")}

    def turn_step(self, action: str) -> tuple[str, float, bool, dict]:
        reward, info = self.score(self.task, action)
        return "", reward, True, info

    def golden_episodes(self) -> list[tuple[dict, list[str], float]]:
        """(task, [reply], expected) for task 0: the reference (1.0), and two wrong replies that hold it (0.0).

        The 0.0 cases are tested as "< 1" (some scorers give a small format credit). Empty without a reference."""
        task = self.task_source.get_task(0)
        good, _ = reference_reply(task)
        if good is None:
            return []
        wrong = self._wrong_answer(task, good)
        return [(task, [f"<think>First a guess: <answer>{wrong}</answer>.</think>\n<answer>\n{good}\n</answer>"], 1.0),
                (task, [f"At first I get {good}.\nNo: the answer is {wrong}"], 0.0),
                (task, [f"<think>It is <answer>{good}</answer>.</think>\n<answer>{wrong}</answer>"], 0.0)]

    def _wrong_answer(self, task: dict, good: str) -> str:
        """Another task's reference answer (a wrong answer in the right format) when the dataset has reference
        answers and one differs among tasks 1..7, else a marked non-answer."""
        if task["answer"] is not None:
            for i in range(1, min(8, self.task_source.num_tasks)):
                other = self.task_source.get_task(i)["answer"]
                if other is not None and other.strip() != good.strip():
                    return other
        return "no solution"

    def golden_check(self) -> GoldenResult:
        """Run `golden_episodes` without raising: "verified", "verified_reference_free", "unverified" or "failed".

        "verified_reference_free": the accepted reply is library-provided, not a reference answer."""
        task = self.task_source.get_task(0)
        _, source = reference_reply(task)
        episodes = self.golden_episodes()
        if not episodes:
            return GoldenResult("unverified", source, "no reference answer and no library-provided reply")
        try:
            for i, (ep_task, (reply,), want) in enumerate(episodes):
                got, info = self.score(ep_task, reply)
                if (got == 1.0) != (want == 1.0):
                    return GoldenResult("failed", source, f"golden reply {i} scored {got} (want "
                                        f"{'1' if want == 1.0 else '< 1'}; {info['reason']!r}); reply {reply[:120]!r}")
        finally:
            self.task, self._done = None, True
        return GoldenResult("verified" if source == "answer" else "verified_reference_free", source)

    def self_check(self) -> None:
        """`golden_check`; raises RuntimeError when it failed, or when unverified and not `allow_unverified`."""
        result = self.golden_check()
        if result.status == "failed" or (result.status == "unverified" and not self.allow_unverified):
            raise RuntimeError(f"{ENV_ID} self-check for dataset {self.task_source.name!r}: {result.status}: "
                               f"{result.reason}" + (" (pass allow_unverified=True to use it anyway)"
                                                     if result.status == "unverified" else ""))
