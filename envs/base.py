"""Text environments: the gymnasium interface every posttrain environment implements (docs/environments.md).

`TextEnv` is the base class: ``reset(seed=, options={"task": task})``, then ``step(text)`` until terminated or
truncated, ``info["status"]`` one of `answers.STATUSES`. `TaskSource`s are deterministic and indexable, so a
training cursor survives a resume. Every env scores its `golden_episodes` at construction (docs/design.md, 7).
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import gymnasium
import numpy as np
from gymnasium.spaces import Text

from envs.verify import answers
MAX_TEXT_CHARS = 1 << 20  # generous bound for observations and actions (characters)


class AnyText(Text):
    """`gymnasium.spaces.Text` holding any Unicode string of up to `max_length` characters (samples printable ASCII)."""

    def __init__(self, max_length: int = MAX_TEXT_CHARS, *, min_length: int = 0) -> None:
        import string

        super().__init__(max_length, min_length=min_length, charset=string.printable)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length


@runtime_checkable
class TaskSource(Protocol):
    """A finite, deterministic, indexable set of task dicts for one split ("train" or "test")."""

    split: str

    @property
    def num_tasks(self) -> int: ...

    def get_task(self, index: int) -> dict: ...


class ListTaskSource:
    """A `TaskSource` over an in-memory sequence of task dicts; `get_task` returns a shallow copy.

    Raises ValueError on an empty list, IndexError on an index outside [0, num_tasks).
    """

    def __init__(self, tasks: Sequence[Mapping[str, Any]], *, split: str, name: str = "tasks") -> None:
        if not tasks:
            raise ValueError(f"{name}: task list for split {split!r} is empty")
        self._tasks = list(tasks)
        self.split = split
        self.name = name

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    def get_task(self, index: int) -> dict:
        check_index(index, self.num_tasks, self.name)
        return dict(self._tasks[index])


def check_index(index: int, num_tasks: int, name: str) -> None:
    """Raise TypeError / IndexError unless `index` is an int in [0, num_tasks)."""
    if not isinstance(index, int) or isinstance(index, bool):
        raise TypeError(f"{name}: task index must be an int, got {type(index).__name__}")
    if not 0 <= index < num_tasks:
        raise IndexError(f"{name}: task index {index} outside [0, {num_tasks})")


def require_keys(task: Mapping[str, Any], keys: Sequence[str], env_name: str) -> None:
    """Raise ValueError naming the missing keys when `task` lacks any of `keys`."""
    missing = [k for k in keys if k not in task]
    if missing:
        raise ValueError(f"{env_name}: task is missing keys {missing}; got keys {sorted(task)}")


def as_reward(value: Any) -> float | None:
    """`value` as a float when it is a real number, else None; the one rule for what an env may return as a reward.

    Real: any `numbers.Real` (numpy scalars included) and bools (Python's and numpy's) as 1.0 / 0.0. Anything else (a
    str such as "1.0", None, complex, arrays, 0-d included) gives None, never parsed or coerced. NaN and inf pass.
    """
    if isinstance(value, (numbers.Real, np.bool_)):
        return float(value)
    return None


def shown_value(value: Any, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters: how an env's malformed output is quoted in an error."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def checked_reset(result: Any, env_id: str) -> tuple[str, dict]:
    """An env's `reset` return value as (str observation, info dict); TypeError naming `env_id` for anything else."""
    shown = shown_value(result)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(f"env {env_id!r}: reset returned {shown}; expected gymnasium's (observation, info) pair")
    obs, info = result
    if not isinstance(obs, str):
        raise TypeError(f"env {env_id!r}: reset returned an observation of type {type(obs).__name__} ({shown}); "
                        "expected a str (the first user message)")
    if not isinstance(info, Mapping):
        raise TypeError(f"env {env_id!r}: reset returned info of type {type(info).__name__} ({shown}); expected a "
                        "dict")
    return obs, dict(info)


def cap_text(text: str, max_chars: int) -> str:
    """`text` cut to its head and tail (tracebacks end with the error), `max_chars` in all, around a cut marker."""
    if len(text) <= max_chars:
        return text
    head, tail = max_chars - max_chars // 2, max_chars // 2
    return f"{text[:head]}\n... [{len(text) - head - tail} characters truncated] ...\n{text[len(text) - tail:]}"


class TextEnv(gymnasium.Env):
    """Base class of posttrain's text environments (single- or multi-turn).

    Subclasses implement `first_observation`, `turn_step` and `golden_episodes`, and may override
    `validate_task` and `on_truncate`. `max_turns` is the number of step() calls after which a
    non-terminated episode is truncated (1 for single-turn tasks).
    """

    metadata = {"render_modes": []}

    def __init__(self, task_source: TaskSource, *, max_turns: int = 1, self_check: bool = True) -> None:
        if not isinstance(task_source, TaskSource):
            raise TypeError(f"{type(self).__name__}: task_source must implement TaskSource, got "
                            f"{type(task_source).__name__}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"{type(self).__name__}: max_turns must be an int >= 1, got {max_turns!r}")
        self.task_source = task_source
        self.max_turns = max_turns
        self.observation_space = AnyText()
        self.action_space = AnyText()
        self.task: dict | None = None
        self.turn = 0
        self._done = True
        if self_check:
            self.self_check()

    # -- hooks for subclasses ------------------------------------------------------------------------

    def validate_task(self, task: dict) -> dict:
        """Check (and possibly complete) a task dict; raise ValueError on a malformed one."""
        return task

    def first_observation(self, task: dict) -> str:
        """The first user message of an episode on `task`."""
        raise NotImplementedError

    def turn_step(self, action: str) -> tuple[str, float, bool, dict]:
        """One turn: returns (observation, reward, terminated, info)."""
        raise NotImplementedError

    def on_truncate(self, reward: float, info: dict) -> tuple[float, dict]:
        """Score an episode that reached max_turns without terminating (default: 0, status "wrong")."""
        verdict = answers.Verdict(0.0, "wrong", gold=info.get("gold"),
                                    reason=f"max_turns={self.max_turns} reached without a final answer")
        return 0.0, {**info, **verdict.info()}

    def golden_episodes(self) -> list[tuple[dict, list[str], float]]:
        """Known episodes for `self_check`: (task, actions, expected final reward), at least one 1 and one 0."""
        raise NotImplementedError

    # -- gymnasium API ------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """Start an episode on ``options["task"]``, or on a task drawn with `seed` from the source.

        Raises TypeError when the task is not a mapping, ValueError when it lacks required keys.
        """
        super().reset(seed=seed)
        task = (options or {}).get("task")
        if task is None:
            index = int(self.np_random.integers(self.task_source.num_tasks))
            task = self.task_source.get_task(index)
        if not isinstance(task, Mapping):
            raise TypeError(f"{type(self).__name__}: options['task'] must be a dict, "
                            f"got {type(task).__name__}")
        self.task = self.validate_task(dict(task))
        self.turn = 0
        self._done = False
        observation = self.first_observation(self.task)
        return observation, {"task_id": self.task.get("id"), "split": self.task_source.split, "turn": 0}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """Apply one model turn. Raises RuntimeError outside an episode, TypeError on a non-str action.

        Malformed text never raises: it scores 0 with ``info["reason"]``. A reward that is no real number
        (`as_reward`) is returned unchanged, never coerced, for the caller to refuse.
        """
        if self._done:
            raise RuntimeError(f"{type(self).__name__}: step() called outside an episode; call reset()")
        if not isinstance(action, str):
            raise TypeError(f"{type(self).__name__}: action must be a str, got {type(action).__name__}")
        self.turn += 1
        observation, reward, terminated, info = self.turn_step(action)
        truncated = False
        if not terminated and self.turn >= self.max_turns:
            truncated = True
            reward, info = self.on_truncate(reward, info)
        self._done = terminated or truncated
        info = {**info, "turn": self.turn, "task_id": self.task.get("id")}
        value = as_reward(reward)
        return observation, reward if value is None else value, bool(terminated), truncated, info

    def play(self, task: Mapping, actions: Sequence[str]) -> tuple[float, dict]:
        """The last step's (reward, info) of an episode on `task` playing `actions` until it ends; (0.0, {}) if none."""
        self.reset(options={"task": task})
        reward, info = 0.0, {}
        for action in actions:
            _, reward, terminated, truncated, info = self.step(action)
            if terminated or truncated:
                break
        return reward, info

    # -- invariant 7 --------------------------------------------------------------------------------

    def self_check(self) -> None:
        """Run `golden_episodes`; raise RuntimeError if any scores other than expected."""
        episodes = self.golden_episodes()
        expected = {float(r) for _, _, r in episodes}
        if not {0.0, 1.0} <= expected:
            raise RuntimeError(f"{type(self).__name__}: golden episodes must include rewards 0 and 1")
        for task, actions, want in episodes:
            reward, info = self.play(task, actions)
            if reward != want:
                raise RuntimeError(
                    f"{type(self).__name__} self-check failed on task {task.get('id')!r}: expected reward "
                    f"{want}, got {reward!r} (status={info.get('status')!r}, reason={info.get('reason')!r})")
        self.task, self._done = None, True


class QuestionAnswerEnv(TextEnv):
    """Single-turn question answering scored by `answers.score_math`.

    Task dict: ``{"question": str, "answer": str, "id"?: str}``; ``answer`` is the bare reference answer ("122") or a
    GSM8K solution ending in ``#### <answer>``. The observation is the question followed by `instruction`.
    """

    instruction = ""
    think_tags = answers.THINK_TAGS  # reasoning trace to skip before extraction (None: read the whole reply)

    def validate_task(self, task: dict) -> dict:
        require_keys(task, ("question", "answer"), type(self).__name__)
        if not isinstance(task["question"], str) or not task["question"].strip():
            raise ValueError(f"{type(self).__name__}: task['question'] must be a non-empty str")
        return {**task, "gold": answers.gold_answer(task["answer"])}

    def first_observation(self, task: dict) -> str:
        return task["question"] + self.instruction

    def turn_step(self, action: str) -> tuple[str, float, bool, dict]:
        verdict = answers.score_math(action, self.task["gold"], think_tags=self.think_tags)
        return "", verdict.reward, True, verdict.info()

    def golden_answer(self, task: dict) -> str:
        """A completion known to be correct for `task` (used by the self-check)."""
        return f"#### {answers.gold_answer(task['answer'])}"

    def golden_episodes(self) -> list[tuple[dict, list[str], float]]:
        task = self.task_source.get_task(0)
        gold = answers.gold_answer(task["answer"])
        return [(task, [self.golden_answer(task)], 1.0),
                (task, [f"#### {wrong_answer(gold)}"], 0.0),
                (task, [""], 0.0)]


def wrong_answer(gold: str) -> str:
    """An answer that is certainly not equivalent to `gold`: gold + 1 for numbers, else a word."""
    value = answers.as_fraction(answers.normalize_answer(gold))
    return str(value + 1) if value is not None else "not-" + gold.replace(" ", "")
