"""GSM8K-v0: grade-school math word problems (Cobbe et al. 2021, arXiv:2110.14168).

Tasks come from ``path`` (JSONL, or JSONL.gz), else for the test split the copy shipped in this package (1,319
problems, MIT licence: data/GSM8K_LICENSE), else TFDS, else HuggingFace ``datasets`` (`load_gsm8k`). Reward 1 when
the extracted answer is numerically equivalent to the ``####`` answer.
"""
from __future__ import annotations

import gzip
import json
import os
import pathlib

from envs import base

SPLITS = ("train", "test")
PACKAGED = {"test": pathlib.Path(__file__).parent / "data" / "gsm8k_test.jsonl.gz"}  # split -> the shipped copy
INSTRUCTION = ("\n\nSolve the problem step by step. End your reply with the final answer on its own line "
               "in the form \"#### <number>\".")


def read_jsonl(path: str, split: str) -> list[dict]:
    """Rows ``{"question", "answer": "... #### N"}`` of a JSONL file (or ``<path>/<split>.jsonl``), ids added.

    Raises FileNotFoundError when the file is missing, ValueError on a row that is not JSON or lacks a key."""
    if os.path.isdir(path):
        path = os.path.join(path, f"{split}.jsonl")
        path = path if os.path.isfile(path) or not os.path.isfile(path + ".gz") else path + ".gz"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GSM8K: no such file {path!r} (expected JSONL of "
                                "{\"question\": ..., \"answer\": \"... #### N\"})")
    rows = []
    with (gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"GSM8K: {path}:{line_no} is not JSON: {exc}") from None
            if not isinstance(row, dict) or not {"question", "answer"} <= set(row):
                raise ValueError(f"GSM8K: {path}:{line_no} lacks 'question'/'answer'")
            rows.append({"id": f"gsm8k-{split}-{len(rows)}", "question": row["question"],
                         "answer": row["answer"]})
    return rows


def _load_tfds(split: str, data_dir: str | None) -> list[dict]:
    import tensorflow_datasets as tfds

    ds = tfds.load("gsm8k", split=split, data_dir=data_dir, download=False)
    rows = []
    for ex in tfds.as_numpy(ds):
        q, a = ex["question"], ex["answer"]
        rows.append({"id": f"gsm8k-{split}-{len(rows)}",
                     "question": q.decode() if isinstance(q, bytes) else str(q),
                     "answer": a.decode() if isinstance(a, bytes) else str(a)})
    return rows


def _load_hf(split: str) -> list[dict]:
    import datasets  # optional dependency

    ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
    return [{"id": f"gsm8k-{split}-{i}", "question": r["question"], "answer": r["answer"]}
            for i, r in enumerate(ds)]


def load_gsm8k(split: str = "test", path: str | None = None, data_dir: str | None = None) -> list[dict]:
    """GSM8K rows ``{"id", "question", "answer"}`` of `split` ("train" or "test").

    Args:
      path: a JSONL (or JSONL.gz) file or a directory with ``<split>.jsonl``; when given, it is the only source.
        Without it the test split is the copy shipped in this package (`PACKAGED`); the train split is read from
        TFDS or HuggingFace ``datasets`` when either has it.
      data_dir: TFDS data directory (when `path` is None).
    Raises ValueError on an unknown split, FileNotFoundError when no source can provide the data.
    """
    if split not in SPLITS:
        raise ValueError(f"GSM8K: split must be one of {SPLITS}, got {split!r}")
    if path is not None:
        return read_jsonl(os.fspath(path), split)
    if split in PACKAGED and PACKAGED[split].is_file():
        return read_jsonl(str(PACKAGED[split]), split)
    errors = []
    for name, loader in (("tfds", lambda: _load_tfds(split, data_dir)), ("hf datasets", lambda: _load_hf(split))):
        try:
            rows = loader()
            if rows:
                return rows
            errors.append(f"{name}: empty")
        except Exception as exc:  # noqa: BLE001 - each optional loader may fail in its own way
            errors.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    raise FileNotFoundError(f"GSM8K split {split!r}: no path given and no loader worked ({'; '.join(errors)}). "
                            "Pass path=<file.jsonl or directory with train.jsonl/test.jsonl>.")


class GSM8KTasks(base.ListTaskSource):
    """`TaskSource` over GSM8K rows; see `load_gsm8k` for arguments and errors."""

    def __init__(self, split: str = "test", *, path: str | None = None, data_dir: str | None = None) -> None:
        super().__init__(load_gsm8k(split, path, data_dir), split=split, name=f"GSM8K[{split}]")


class GSM8KEnv(base.QuestionAnswerEnv):
    """posttrain/GSM8K-v0: single-turn; reward 1 when the extracted answer equals N ("$1,234.00" == 1234).

    Task dict: ``{"question", "answer": "<solution> #### N"}`` (or a bare "N"). Args as `load_gsm8k`;
    max_examples keeps the first rows."""

    instruction = INSTRUCTION

    def __init__(self, *, split: str = "test", path: str | None = None, data_dir: str | None = None,
                 max_examples: int | None = None, self_check: bool = True) -> None:
        tasks = GSM8KTasks(split, path=path, data_dir=data_dir)
        if max_examples is not None:
            if not isinstance(max_examples, int) or max_examples < 1:
                raise ValueError(f"GSM8K: max_examples must be an int >= 1, got {max_examples!r}")
            tasks = base.ListTaskSource([tasks.get_task(i) for i in range(min(max_examples, tasks.num_tasks))],
                                        split=split, name=tasks.name)
        super().__init__(tasks, max_turns=1, self_check=self_check)

    def golden_answer(self, task: dict) -> str:
        return task["answer"]  # the reference solution itself, "... #### N"
