"""The long-context environments: DocAnalysis-v0, LongSynthetic-v0 and CodebaseQA-v0 over generated tasks.

`GeneratedTasks` makes task `i` of a split on demand from its seed (`lengths.task_seed`: the test split is fixed
and disjoint from train), the question type cycling through `types`. Replies are scored by the task's named
verifier (`lengths.score_reply`) on the answer between <answer> tags.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from envs import base
from envs.tasks.long_context import codebase, doc_questions, lengths, synthetic

MakeTask = Callable[..., dict]
CACHED_TASKS = 4  # the last tasks made, kept: an episode asks for its task more than once
MAX_CHARS_PER_TOKEN = 16  # bound of the observation space: prompts of MAX_TARGET_TOKENS tokens fit


class GeneratedTasks:
    """A `TaskSource` of tasks generated on demand by `make_task`; the same index always gives the same task.

    Args:
      make_task: ``(seed, *, target_tokens, depth, count_tokens, kind) -> dict``; types: the question types cycled.
      split: "train" or "test"; num_tasks / num_test: the sizes of the two splits; seed: the train key.
      target_tokens, depth: the prompt's length and where its evidence starts (None: drawn per task in [0, 1]).
      tokenizer: "" (one token per 4 characters) or a HF tokenizer.json path: the tokens `target_tokens` counts.

    Raises:
      ValueError: a bad split, size, length, depth or type; FileNotFoundError: no such tokenizer file.
    """

    def __init__(self, make_task: MakeTask, types: Sequence[str], *, split: str = "train",
                 target_tokens: int = 8192, depth: float | None = None, tokenizer: str = "",
                 num_tasks: int = 100_000, num_test: int = 200, seed: int = 0, name: str = "long_context") -> None:
        lengths.check_length(target_tokens, depth)
        lengths.task_seed(split, 0, seed)  # checks the split
        if not types or len(set(types)) != len(types):
            raise ValueError(f"{name}: types must be distinct question types, got {list(types)}")
        for size_name, size in (("num_tasks", num_tasks), ("num_test", num_test)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}: {size_name} must be an int >= 1, got {size!r}")
        self.make_task, self.types, self.split, self.name = make_task, tuple(types), split, name
        self.target_tokens, self.depth, self.seed = target_tokens, depth, int(seed)
        self.count_tokens = lengths.token_counter(tokenizer)
        self._size = num_test if split == "test" else num_tasks
        self._cache: dict[int, dict] = {}

    @property
    def num_tasks(self) -> int:
        return self._size

    def get_task(self, index: int) -> dict:
        base.check_index(index, self._size, self.name)
        if index not in self._cache:
            seed = lengths.task_seed(self.split, index, self.seed)
            depth = random.Random(f"depth:{seed}").random() if self.depth is None else float(self.depth)
            task = self.make_task(seed, target_tokens=self.target_tokens, depth=depth,
                                  count_tokens=self.count_tokens, kind=self.types[index % len(self.types)])
            self._cache = {**dict(list(self._cache.items())[-(CACHED_TASKS - 1):]), index: task}
        return dict(self._cache[index])


class LongContextEnv(base.TextEnv):
    """Single-turn: the prompt holds the document and the question.

    Reward 1 when the answer between <answer> tags is the gold answer (`numeric` with tolerance 0, or `exact`
    ignoring case). Subclasses name the family."""

    make_task: MakeTask
    all_types: tuple[str, ...] = ()

    def __init__(self, *, split: str = "train", target_tokens: int = 8192, depth: float | None = None,
                 tokenizer: str = "", types: Sequence[str] | None = None, num_tasks: int = 100_000,
                 num_test: int = 200, seed: int = 0, self_check: bool = True) -> None:
        types = tuple(self.all_types if types is None else types)
        unknown = [t for t in types if t not in self.all_types]
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown types {unknown}; valid types: {list(self.all_types)}")
        tasks = GeneratedTasks(type(self).make_task, types, split=split, target_tokens=target_tokens, depth=depth,
                               tokenizer=tokenizer, num_tasks=num_tasks, num_test=num_test, seed=seed,
                               name=type(self).__name__)
        super().__init__(tasks, max_turns=1, self_check=self_check)
        self.observation_space = base.AnyText(MAX_CHARS_PER_TOKEN * lengths.MAX_TARGET_TOKENS)

    def validate_task(self, task: dict) -> dict:
        base.require_keys(task, ("prompt", "question", "answer", "accepted", "verifier"), type(self).__name__)
        return task

    def first_observation(self, task: dict) -> str:
        return task["prompt"]

    def turn_step(self, action: str) -> tuple[str, float, bool, dict]:
        verdict = lengths.score_reply(self.task, action)
        depth = self.task["depth_tokens"] / max(self.task["document_tokens"], 1)  # as placed (`depth` may not fit)
        return "", verdict.reward, True, {**verdict.info(), "evidence_depth": depth}

    def golden_answer(self, task: dict) -> str:
        """The reply known to be correct: the gold answer between <answer> tags."""
        return f"<answer>{task['answer']}</answer>"

    def golden_episodes(self) -> list[tuple[dict, list[str], float]]:
        task = self.task_source.get_task(0)
        gold = task["answer"]
        wrong = str(int(gold) + 1) if task["verifier"]["name"] == "numeric" else f"not {gold}"
        return [(task, [self.golden_answer(task)], 1.0), (task, [f"<answer>{wrong}</answer>"], 0.0),
                (task, [""], 0.0)]


class DocAnalysisEnv(LongContextEnv):
    """posttrain/DocAnalysis-v0: questions on generated company reports (`doc_questions.TYPES`)."""

    make_task = staticmethod(doc_questions.make_task)
    all_types = doc_questions.TYPES


class LongSyntheticEnv(LongContextEnv):
    """posttrain/LongSynthetic-v0: RULER-style needle, variable-tracking and common-word tasks (`synthetic.TYPES`)."""

    make_task = staticmethod(synthetic.make_task)
    all_types = synthetic.TYPES


class CodebaseQAEnv(LongContextEnv):
    """posttrain/CodebaseQA-v0: questions on a generated Python package, answered by running it (`codebase.TYPES`)."""

    make_task = staticmethod(codebase.make_task)
    all_types = codebase.TYPES
