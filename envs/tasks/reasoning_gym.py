"""ReasoningGym-v0: one gymnasium text env over any `reasoning-gym` dataset (~106 procedural domains).

Source: reasoning-gym (Stojanovski et al. 2025, "REASONING GYM: Reasoning Environments for Reinforcement
Learning with Verifiable Rewards", arXiv:2505.24760; PyPI ``reasoning-gym``, pure Python, offline). Its API is
used as is: ``reasoning_gym.create_dataset``-style construction from the registered (dataset, config) classes,
each dataset's own ``score_answer(answer, entry) -> float in [0, 1]`` and its curricula for difficulty levels;
answers are read by the library's convention, the last ``<answer>...</answer>`` (`envs.verify.tagged`).

An episode: the question plus `INSTRUCTION` (or the env's ``instruction``; answer inside ``<answer>`` tags); the
reply after the last ``</think>`` is searched for the last ``<answer>...</answer>`` (`envs.verify.tagged.read_answer`;
multi-line answers kept); the reward is the dataset's score of that answer, partial credit included (``info["score"]``);
``info["status"]`` is "ok" only at score 1. A reply with no answer tag at all (small instruct models such as
SmolLM2-135M ignore the instruction and write "The answer is 12.") is read by a conservative fallback on its
last non-empty line only (`tagged.fallback_answer`: ``\\boxed{}``, "answer is/: X", "... = X", "... is X", a lone
token), so a revised or buried number never scores; ``fallback=False`` keeps tags only.

Splits: "train" is the dataset built with ``seed`` and ``size``; "test" the same config with seed
``seed + TEST_SEED_OFFSET`` and ``num_test`` items. The question sets are disjoint (`held_out`: a question is
held out when its CRC32 falls in one of `HELD_OUT_BUCKETS` buckets; each split redraws an item of the wrong side,
deterministically), so a small procedural task space cannot leak eval questions into training. Tasks carry the
dataset's whole entry (question, answer, metadata), so any worker can score them whatever its own kwargs. No JAX.
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

from envs.verify import answers as verifiers
from envs.verify import tagged
ENV_ID = "posttrain/ReasoningGym-v0"
INSTRUCTION = ("\n\nThink it through, then give only the final answer inside <answer></answer> tags, "
               "in the format the question asks for (it may span several lines).")
# For small instruct models: SmolLM2-135M echoes the long instruction's words ("in the format the question asks
# for", empty "<answer></answer>") instead of answering; this one keeps the convention in a few words.
SHORT_INSTRUCTION = "\n\nGive only the final answer inside <answer></answer> tags."
TEST_SEED_OFFSET = 1_000_003  # test split seed = train seed + this (a different procedural stream)
HELD_OUT_BUCKETS = 8  # a question is held out (test split only) when crc32(question) % this == 0
MAX_DRAWS = 256  # draws per task before a split gives up: (7/8)**256 ~ 1e-15 for a test task of a large space
# Metadata fields in which reasoning-gym ships a reply its own scorer accepts, for datasets without a reference
# answer (answer=None): graph_color "possible_answer", propositional_logic "example_answer", rubiks_cube
# "example_correct_answer". Datasets with neither an answer nor one of these are "unverified".
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
    """A context in which what the library prints goes to stderr: some generators print to stdout (bf's prints
    "." per program it compiles), which would corrupt a command's output (`posttrain domains`, `status --json`)."""
    return contextlib.redirect_stdout(sys.stderr)


def containment_credit(answer: str, gold: str, value: float) -> float:
    """A dataset scorer's partial credit `value` for an answer that contains the whole gold text, kept only when
    what surrounds it is punctuation and spaces ("-1048." for -1048), else 0; `value` unchanged when the gold text
    is not in the answer (a graded score of another kind). reasoning-gym's default scorer and its
    `compute_decimal_reward` pay len(gold) / len(answer) for any answer containing the gold: 0.45 for
    "-1047 -1048", 0.36 for "-1048 or -1047", so listing candidates earned a share without choosing one."""
    if gold not in answer:
        return value
    rest = answer.replace(gold, "", 1)
    return value if not any(ch.isalnum() for ch in rest) else 0.0


def dataset_names() -> list[str]:
    """Sorted names of every dataset registered in reasoning-gym (``reasoning_gym.factory.DATASETS``)."""
    return sorted(library().factory.DATASETS)


def parse_config(config: Mapping[str, Any] | str | None, dataset: str = "?") -> dict:
    """A dataset config as a dict: None -> {}, a JSON object string -> its dict, a mapping -> a copy.

    Env specs pass the config as a JSON string so their kwargs stay hashable. Raises ValueError on bad JSON
    or a JSON value that is not an object, TypeError on any other type.
    """
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


def build_dataset(dataset: str, config: Mapping[str, Any] | str | None = None, *, seed: int = 0, size: int = 1000,
                  level: int | None = None):
    """A reasoning-gym dataset object (``ProceduralDataset``) for `dataset` with `config`, `seed`, `size`.

    `level` (optional) applies the library's curriculum (``create_curriculum(dataset).set_global_level(level)``,
    then ``generate_configuration`` over `config`): the curriculum's attributes override those keys of `config`.
    Raises ValueError on an unknown dataset (with close names), a config that sets seed/size (kwargs of the
    env), unknown config keys (naming them and the valid ones), a config the library rejects, or a level
    outside [0, max_level]; TypeError on a config of the wrong type.
    """
    rg = library()
    datasets = rg.factory.DATASETS
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
    """Whether `question` belongs to the held-out (test) side of the split: ``crc32(question) % HELD_OUT_BUCKETS
    == 0`` (stable across processes and versions, unlike ``hash``). Train tasks never have it, test tasks always,
    so the two splits' question sets are disjoint whatever the seeds and the size of the task space."""
    return zlib.crc32(question.encode("utf-8", "surrogatepass")) % HELD_OUT_BUCKETS == 0


def reference_reply(entry: Mapping[str, Any]) -> tuple[str | None, str]:
    """(an answer the dataset's scorer should accept, where it came from): the entry's reference answer
    ("answer"), else a library-provided reply in its metadata (`REFERENCE_REPLY_KEYS`), else (None, "none")."""
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

    Args:
      dataset: a reasoning-gym dataset name (`dataset_names()`).
      config: its config (mapping or JSON object string; library defaults for missing keys).
      split: "train" (seed `seed`, `size` items) or "test" (seed `seed + TEST_SEED_OFFSET`, `num_test` items);
        train questions are never `held_out`, test questions always are (disjoint question sets).
      level: optional curriculum level.
    Task dict: ``{"id": "reasoning_gym/<dataset>-<split>-<i>", "dataset", "question", "answer" (str or None),
    "metadata" (the library's dict), "level"}``. Raises ValueError on bad arguments, IndexError on a bad index.
    """

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
    """Outcome of `ReasoningGymEnv.golden_check`: status (one of GOLDEN_STATUSES), where the accepted reply
    came from ("answer", "metadata.<key>", "none") and, when not verified, why."""

    status: str
    source: str
    reason: str = ""


class ReasoningGymEnv(base.TextEnv):
    """posttrain/ReasoningGym-v0: single-turn; reward = the dataset's ``score_answer`` of the tagged answer.

    Kwargs: those of `ReasoningGymTasks` (``dataset`` required), ``self_check`` (run `golden_check` at
    construction: RuntimeError when it fails), ``allow_unverified`` (accept a dataset with no reference reply,
    "unverified", instead of raising), ``fallback`` (default True: a reply without any answer tag is read by
    `envs.verify.tagged.fallback_answer`, its last line; False: tags only) and ``instruction`` (the text after the
    question; None: `INSTRUCTION`; `SHORT_INSTRUCTION` suits models too small to follow the tag format). Scorer
    exceptions on odd replies score 0 with the reason in info; ``info["method"]`` says how the answer was read
    (`envs.verify.tagged.read_answer`).
    """

    think_tags = verifiers.THINK_TAGS

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
        shown = answer if answer is None or len(answer) <= verifiers.MAX_ANSWER_CHARS else answer[:200] + "..."
        return value, {"status": status, "score": value, "extracted": shown, "gold": task["answer"],
                       "method": method, "reason": reason, "level": task.get("level")}

    def turn_step(self, action: str) -> tuple[str, float, bool, dict]:
        reward, info = self.score(self.task, action)
        return "", reward, True, info

    def golden_episodes(self) -> list[tuple[dict, list[str], float]]:
        """(task, [reply], expected) for task 0: the reference reply after a think block (expect 1.0), an untagged
        reply that states the reference and then revises it to a wrong answer on its last line (read by the
        fallback), and a wrong answer in tags after a think block holding the reference
        (both expected below 1, written as 0.0: `golden_check` tests them with "< 1", since some scorers give
        a small format credit, e.g. 0.01, even to a missing answer). Empty when there is no reference reply."""
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
        """Runs `golden_episodes` without raising: "verified" (the reference answer scores 1 through extraction,
        the other replies below 1), "verified_reference_free" (same with a library-provided reply), "unverified"
        (no reply known to be correct) or "failed" (with the reason)."""
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
