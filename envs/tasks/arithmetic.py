"""Arithmetic-v0: procedurally generated integer arithmetic, the quickstart's default task.

Default: two-digit addition. A keyed bijection (`permute`) independent of ``seed`` puts the first ``num_test``
items of the task space in the fixed "test" split; "train" never yields a test item, and ``get_task(i)`` is O(1).
"""
from __future__ import annotations

from collections.abc import Sequence

from envs import base

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
PROMPT = "What is {a} {op} {b}? Answer with just the number."
_SPLIT_KEY = 0x5EED_7E57  # fixed: the test set does not move when the train shuffle seed changes
_M64 = (1 << 64) - 1


def _mix(x: int, key: int) -> int:
    """splitmix64 finaliser of x + key (Steele et al. 2014): a 64-bit hash."""
    x = (x + key * 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def permute(index: int, n: int, key: int) -> int:
    """Image of `index` under a keyed bijection of [0, n): a 4-round Feistel network with cycle walking.

    Raises ValueError when index is outside [0, n)."""
    if not 0 <= index < n:
        raise ValueError(f"permute: index {index} outside [0, {n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = index
    while True:
        left, right = x >> half, x & mask
        for r in range(4):
            left, right = right, left ^ (_mix(right, key * 8 + r) & mask)
        x = (left << half) | right
        if x < n:
            return x


class ArithmeticTasks:
    """`TaskSource` of arithmetic questions for one split.

    Args:
      digits: operand width (>= 1): operands in [10**(digits-1), 10**digits - 1], or [0, 9] for digits=1.
      num_test: size of the held-out test split (at most half the task space).
      seed: shuffle key of the train order (the test set does not depend on it).
      prompt: question template with {a}, {op}, {b}.
    Raises ValueError on bad arguments, IndexError on a bad index."""

    def __init__(self, split: str = "train", *, digits: int = 2, ops: Sequence[str] = ("+",),
                 num_test: int = 200, seed: int = 0, prompt: str = PROMPT) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"ArithmeticTasks: split must be 'train' or 'test', got {split!r}")
        if not isinstance(digits, int) or digits < 1:
            raise ValueError(f"ArithmeticTasks: digits must be an int >= 1, got {digits!r}")
        ops = tuple(ops)
        if not ops or any(op not in OPS for op in ops) or len(set(ops)) != len(ops):
            raise ValueError(f"ArithmeticTasks: ops must be distinct items of {sorted(OPS)}, got {ops}")
        try:
            prompt.format(a=1, op="+", b=2)
        except (AttributeError, KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"ArithmeticTasks: prompt must be a template with {{a}}, {{op}}, {{b}}: {exc!r}") from None
        self.split, self.digits, self.ops, self.seed, self.prompt = split, digits, ops, int(seed), prompt
        self.low = 10 ** (digits - 1) if digits > 1 else 0
        self.width = 10 ** digits - self.low
        self.space = self.width * self.width * len(ops)
        if not isinstance(num_test, int) or not 1 <= num_test <= self.space // 2:
            raise ValueError(f"ArithmeticTasks: num_test must be in [1, {self.space // 2}], got {num_test!r}")
        self.num_test = num_test

    @property
    def num_tasks(self) -> int:
        return self.num_test if self.split == "test" else self.space - self.num_test

    def item(self, code: int) -> tuple[str, int, int]:
        """(op, a, b) of position `code` in the unshuffled task space."""
        op_index, rest = divmod(code, self.width * self.width)
        a, b = divmod(rest, self.width)
        return self.ops[op_index], self.low + a, self.low + b

    def code_of(self, index: int) -> int:
        """Position in the task space of task `index` of this split."""
        base.check_index(index, self.num_tasks, "ArithmeticTasks")
        if self.split == "train":
            index = self.num_test + permute(index, self.space - self.num_test, self.seed)
        return permute(index, self.space, _SPLIT_KEY)

    def get_task(self, index: int) -> dict:
        op, a, b = self.item(self.code_of(index))
        return {"id": f"arithmetic-{self.split}-{index}", "question": self.prompt.format(a=a, op=op, b=b),
                "answer": str(OPS[op](a, b)), "operands": [a, b], "op": op}


class ArithmeticEnv(base.QuestionAnswerEnv):
    """posttrain/Arithmetic-v0: single-turn; reward 1 when `answers.extract_answer` reads a op b."""

    def __init__(self, *, split: str = "train", digits: int = 2, ops: Sequence[str] = ("+",),
                 num_test: int = 200, seed: int = 0, self_check: bool = True) -> None:
        tasks = ArithmeticTasks(split, digits=digits, ops=ops, num_test=num_test, seed=seed)
        super().__init__(tasks, max_turns=1, self_check=self_check)

    def golden_answer(self, task: dict) -> str:
        return f"The answer is {task['answer']}."
