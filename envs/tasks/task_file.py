"""TaskFile-v0: a domain read from a task file (JSONL, CSV, Parquet or a TFDS dataset), scored by named verifiers.

A row is a prompt (text or chat messages) and what its verifiers need (`envs.verify.named`); the file format, the
field mapping and the split rule: docs/task_files.md. Every row is checked when the env is built, so a malformed
file is refused (file and line) before any model loads.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from envs import base
from envs.verify import named

ENV_ID = "posttrain/TaskFile-v0"
FORMATS = ("jsonl", "csv", "parquet", "tfds")
SPLITS = ("train", "test", "all")
EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet",
              ".pq": "parquet"}
ROLES = ("system", "user", "assistant")
KNOWN_FIELDS = ("id", "prompt", "answer", "split", "verifier", "system", "metadata")  # besides the verifiers' fields
STRUCTURED = ("choices", "rubric", "schema", "metadata", "verifier", "prompt", "answer")  # CSV cells read as JSON
MAX_SHOWN_ERRORS = 5
_TEMPLATE_FIELD = re.compile(r"\{(\w*)\}")


class TaskFileError(ValueError):
    """A task file that cannot be used: unreadable, or rows that are malformed (each named by file and line)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskFileSettings:
    """How a task file becomes tasks (the env's kwargs).

    Attributes:
      path: the file (.jsonl/.json/.ndjson, .csv, .parquet/.pq) or ``tfds:<name>`` (a TFDS dataset, no download).
      format: one of FORMATS, or "" to read it from the extension.
      split: "train", "test" or "all" (every row, whatever its split).
      test_fraction: in [0, 1]: the share of rows without a ``split`` field held out as "test" (by a hash of the row
        id, so the split does not move when rows are added or reordered).
      unsplit: "hash" (rows without a split field: `test_fraction`), or "test": a file where no row names a split is
        all "test" (a private evaluation set), while one that names splits keeps the hash rule for its blank cells,
        as training reads them.
      fields: {task field: the file's column}, e.g. {"prompt": "question"}.
      answer_after: when set, the answer is the text after the last occurrence of this marker (GSM8K: "####").
      verifier: the verifiers of rows without their own (`named.parse_verifier`: a name, a dict, or a list).
      template: the user message around the prompt: "{prompt}" and any other row field in braces.
      system_prompt: a system message for rows without their own ``system`` field ("": none).
      max_rows: keep the first this many rows of the split (None: all).
      data_dir: the TFDS data directory (``tfds:`` paths).
      tfds_split: the TFDS split read (``tfds:`` paths; default "train").
    """

    path: str
    format: str = ""
    split: str = "train"
    test_fraction: float = 0.1
    unsplit: str = "hash"
    fields: Mapping[str, str] = dataclasses.field(default_factory=dict)
    answer_after: str = ""
    verifier: Any = "exact"
    template: str = "{prompt}"
    system_prompt: str = ""
    max_rows: int | None = None
    data_dir: str | None = None
    tfds_split: str = "train"

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path.strip():
            raise ValueError(f"TaskFile: path must be a file path or 'tfds:<name>', got {self.path!r}")
        fmt = self.format or file_format(self.path)
        if fmt not in FORMATS:
            raise ValueError(f"TaskFile: format {fmt!r} of {self.path!r} is not one of {FORMATS}")
        object.__setattr__(self, "format", fmt)
        if self.unsplit not in ("hash", "test"):
            raise ValueError(f"TaskFile: unsplit must be 'hash' or 'test', got {self.unsplit!r}")
        if self.split not in SPLITS:
            raise ValueError(f"TaskFile: split must be one of {SPLITS}, got {self.split!r}")
        if isinstance(self.test_fraction, bool) or not isinstance(self.test_fraction, (int, float)) or not (
                0 <= self.test_fraction <= 1):
            raise ValueError(f"TaskFile: test_fraction must be a number in [0, 1], got {self.test_fraction!r}")
        if not isinstance(self.fields, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                           for k, v in self.fields.items()):
            raise ValueError(f"TaskFile: fields must map task fields to column names (str -> str), got "
                             f"{self.fields!r}")
        if not isinstance(self.template, str) or "{prompt}" not in self.template:
            raise ValueError(f"TaskFile: template must be a str containing '{{prompt}}', got {self.template!r}")
        if self.max_rows is not None and (isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int)
                                          or self.max_rows < 1):
            raise ValueError(f"TaskFile: max_rows must be an int >= 1 or None, got {self.max_rows!r}")
        object.__setattr__(self, "verifier", named.parse_verifier(self.verifier))


def file_format(path: str) -> str:
    """The format of `path` by its extension (``tfds:`` paths: "tfds"); ValueError for an unknown extension."""
    if path.startswith("tfds:"):
        return "tfds"
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise ValueError(f"TaskFile: cannot tell the format of {path!r} from its extension; use one of "
                         f"{sorted(EXTENSIONS)} or set format= (one of {FORMATS})")
    return EXTENSIONS[ext]


# -------------------------------------------------------------------------------------------------
# Reading records: (where, dict) in file order


def _jsonl(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8-sig") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if path.lower().endswith(".json") and head.startswith("["):  # a .json file holding one array of rows
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise TaskFileError(f"{path}: a JSON array that does not parse (line {e.lineno}: {e.msg})") from None
            for i, row in enumerate(rows, 1):
                yield f"{path}:row {i}", row
            return
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{line_no}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{path}:{line_no}", TaskFileError(f"not JSON ({e.msg} at column {e.colno})")


def _csv(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames:
            return
        start = reader.line_num + 1  # a record's first line (a quoted cell may span several)
        for row in reader:
            where, start = f"{path}:{start}", reader.line_num + 1
            if None in row:
                yield where, TaskFileError(f"more cells than the {len(reader.fieldnames)} columns of the header")
                continue
            yield where, {k: _csv_cell(k, v) for k, v in row.items() if v is not None}


def _csv_cell(key: str, value: str) -> Any:
    """A CSV cell: JSON for the structured fields when it reads as a JSON list or object, else the text."""
    if key in STRUCTURED and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _parquet(path: str) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...: a file it cannot read
        raise TaskFileError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    for i, row in enumerate(table.to_pylist(), 1):
        yield f"{path}:row {i}", row


def _tfds(name: str, split: str, data_dir: str | None) -> Iterator[tuple[str, Any]]:
    import tensorflow_datasets as tfds

    try:
        ds = tfds.load(name, split=split, data_dir=data_dir, download=False)
    except Exception as e:  # noqa: BLE001 - tfds raises many kinds when the data is not prepared
        raise TaskFileError(f"tfds:{name}[{split}]: cannot load without a download ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]})") from None
    for i, ex in enumerate(tfds.as_numpy(ds), 1):
        yield f"tfds:{name}[{split}]:row {i}", {k: _plain(v) for k, v in ex.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def read_records(settings: TaskFileSettings) -> Iterator[tuple[str, Any]]:
    """(where, record) of every row of the file in order; a record that failed to parse is a TaskFileError.

    Raises FileNotFoundError for a missing file, TaskFileError for one that cannot be read at all."""
    path = settings.path
    if settings.format == "tfds":
        yield from _tfds(path.removeprefix("tfds:"), settings.tfds_split, settings.data_dir)
        return
    if not os.path.isfile(path):
        raise FileNotFoundError(f"TaskFile: no such file {path!r}")
    try:
        yield from {"jsonl": _jsonl, "csv": _csv, "parquet": _parquet}[settings.format](path)
    except UnicodeDecodeError as e:
        with open(path, "rb") as f:
            data = f.read()
        at = data.find(e.object[e.start:e.end]) if isinstance(e.object, bytes) else -1
        line = data[:at].count(b"\n") + 1 if at >= 0 else "?"
        raise TaskFileError(f"{path}:{line}: not UTF-8 text ({e.reason}); save the file as UTF-8") from None


# -------------------------------------------------------------------------------------------------
# Rows -> tasks


def _messages(value: Any) -> str:
    """Why `value` is not a chat message list ending with a user message ("" when it is one)."""
    if not value:
        return "prompt is an empty message list"
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return (f"prompt message {i} must be {{'role': one of {list(ROLES)}, 'content': str}}, got "
                    f"{base.shown_value(m, 80)}")
    if value[-1]["role"] != "user":
        return f"the last prompt message must be the user's, got role {value[-1]['role']!r}"
    if any(m["role"] == "system" for m in value[1:]):
        return "a system message may only come first"
    return ""


def _template_fields(template: str) -> list[str]:
    return [name for name in _TEMPLATE_FIELD.findall(template)]


def make_task(where: str, record: Any, settings: TaskFileSettings) -> dict:
    """The task dict of one record; TaskFileError naming the problem (without `where`, which the caller adds)."""
    if isinstance(record, TaskFileError):
        raise record
    if not isinstance(record, Mapping):
        raise TaskFileError(f"a row must be an object with a 'prompt', got {base.shown_value(record, 80)}")
    row = {key: record[column] for key, column in settings.fields.items() if column in record}
    missing_columns = [column for column in settings.fields.values() if column not in record]
    if missing_columns:
        raise TaskFileError(f"no column {missing_columns} (fields mapping {dict(settings.fields)}); the row has "
                            f"{sorted(record)}")
    mapped = set(settings.fields.values())
    row.update({k: v for k, v in record.items() if k not in row and k not in mapped})
    prompt = row.get("prompt")
    task: dict[str, Any] = {"where": where}
    if isinstance(prompt, str):
        if not prompt.strip():
            raise TaskFileError("prompt is empty")
        text, history, system = prompt, [], None
    elif isinstance(prompt, (list, tuple)):
        problem = _messages(list(prompt))
        if problem:
            raise TaskFileError(problem)
        messages = [dict(m) for m in prompt]
        system = messages.pop(0)["content"] if messages[0]["role"] == "system" else None
        text, history = messages[-1]["content"], messages[:-1]
    else:
        raise TaskFileError(f"no prompt: a row needs 'prompt' (a str or a list of chat messages){_columns(record)}")
    if "answer" in row and settings.answer_after:
        answer = row["answer"]
        if not isinstance(answer, str) or settings.answer_after not in answer:
            raise TaskFileError(f"answer has no {settings.answer_after!r} (answer_after): "
                                f"{base.shown_value(answer, 80)}")
        row["answer"] = answer.rsplit(settings.answer_after, 1)[1].strip()
    specs = settings.verifier
    if row.get("verifier") not in (None, ""):
        try:
            specs = named.parse_verifier(row["verifier"])
        except ValueError as e:
            raise TaskFileError(f"verifier: {e}") from None
    if (isinstance(row.get("answer"), (int, float)) and not isinstance(row.get("answer"), bool)
            and not any(s.name == "choice" for s in specs)):  # a choice index stays a number
        row["answer"] = str(row["answer"])
    problem = named.check_row(specs, row)
    if problem:
        raise TaskFileError(f"{problem}{_columns(record)}")
    system = row.get("system") if isinstance(row.get("system"), str) else system
    for name in _template_fields(settings.template):
        if name != "prompt" and name not in row:
            raise TaskFileError(f"the template names {{{name}}}, which the row lacks{_columns(record)}")
    split = row.get("split")
    if split not in (None, "") and split not in ("train", "test"):
        raise TaskFileError(f"split must be 'train' or 'test', got {base.shown_value(split, 40)}")
    task.update({k: v for k, v in row.items() if k not in ("prompt", "verifier", "system")})
    task.update({"id": str(row["id"]) if row.get("id") not in (None, "") else None, "question": text,
                 "history": history, "system": system if system is not None else settings.system_prompt,
                 "verifier": [dataclasses.asdict(s) for s in specs], "split": split or None})
    return task


def _columns(record: Any) -> str:
    return f" (the row has {sorted(record)})" if isinstance(record, Mapping) else ""


def held_out(task_id: str, test_fraction: float) -> bool:
    """Whether a row without a split field is a test row: a hash of its id below `test_fraction` (stable)."""
    digest = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big")
    return digest < test_fraction * 2.0 ** 64


def scan(settings: TaskFileSettings) -> tuple[list[dict], list[tuple[str, str]]]:
    """(tasks of every split in file order, [(where, problem)] of the rows refused); ids and splits assigned.

    Raises FileNotFoundError for a missing file, TaskFileError for a file that cannot be read at all."""
    tasks, errors, seen = [], [], {}
    base_name = os.path.basename(settings.path.removeprefix("tfds:"))
    for where, record in read_records(settings):
        try:
            task = make_task(where, record, settings)
        except TaskFileError as e:
            errors.append((where, " ".join(str(e).split())))
            continue
        line = where.rsplit(":", 1)[1].removeprefix("row ").strip()
        task["id"] = task["id"] or f"{base_name}:{line}"
        if task["id"] in seen:
            errors.append((where, f"id {task['id']!r} repeats the row at {seen[task['id']]}"))
            continue
        seen[task["id"]] = where
        tasks.append(task)
    all_test = settings.unsplit == "test" and not any(t["split"] for t in tasks)
    for task in tasks:
        task["split"] = task["split"] or ("test" if all_test or held_out(task["id"], settings.test_fraction)
                                          else "train")
    return tasks, errors


def load_tasks(settings: TaskFileSettings) -> list[dict]:
    """The tasks of `settings.split`, in file order; every row is checked, whatever its split.

    Raises TaskFileError naming up to MAX_SHOWN_ERRORS malformed rows (file:line: problem) and their count,
    duplicate ids, or a split with no row; FileNotFoundError for a missing file."""
    tasks, errors = scan(settings)
    if errors:
        shown = "; ".join(f"{where}: {problem}" for where, problem in errors[:MAX_SHOWN_ERRORS])
        more = f" (and {len(errors) - MAX_SHOWN_ERRORS} more)" if len(errors) > MAX_SHOWN_ERRORS else ""
        raise TaskFileError(f"{settings.path}: {len(errors)} malformed row(s): {shown}{more}")
    if not tasks:
        raise TaskFileError(f"{settings.path}: no rows")
    chosen = [t for t in tasks if settings.split == "all" or t["split"] == settings.split]
    if not chosen:
        counts = {s: sum(t["split"] == s for t in tasks) for s in ("train", "test")}
        raise TaskFileError(f"{settings.path}: no {settings.split!r} rows (rows per split: {counts}; rows without a "
                            f"split field go to test with probability test_fraction={settings.test_fraction:g})")
    return chosen[:settings.max_rows] if settings.max_rows else chosen


def render_prompt(task: Mapping[str, Any], template: str) -> str:
    """The user message of `task`: `template` with {prompt} and the task's other fields filled in.

    Not str.format: braces inside the values stay as they are."""
    def field(m: re.Match) -> str:
        name = m.group(1)
        if name == "prompt":
            return task["question"]
        value = task.get(name, m.group(0))
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return _TEMPLATE_FIELD.sub(field, template)


def specs_of(task: Mapping[str, Any]) -> tuple[named.VerifierSpec, ...]:
    """The verifiers of a task made by `make_task`."""
    return tuple(named.VerifierSpec(s["name"], dict(s["args"]), float(s["weight"])) for s in task["verifier"])


class TaskFileTasks(base.ListTaskSource):
    """`TaskSource` over the tasks of one split of a task file; see `load_tasks`."""

    def __init__(self, settings: TaskFileSettings) -> None:
        super().__init__(load_tasks(settings), split=settings.split, name=f"TaskFile[{settings.path}:"
                                                                          f"{settings.split}]")


class TaskFileEnv(base.TextEnv):
    """posttrain/TaskFile-v0: single-turn; the reward is the row's verifiers' weighted mean (`named.score`).

    Kwargs: `TaskFileSettings`' fields, and self_check. The reset info carries the row's system prompt and earlier
    chat messages (``system_prompt``, ``prompt_messages``), which the rollout renders before the user message."""

    def __init__(self, *, self_check: bool = True, **kwargs: Any) -> None:
        try:
            self.settings = TaskFileSettings(**kwargs)
        except TypeError as e:
            known = [f.name for f in dataclasses.fields(TaskFileSettings)]
            raise ValueError(f"TaskFile: {e}; keys: {known}") from None
        super().__init__(TaskFileTasks(self.settings), max_turns=1, self_check=self_check)

    def validate_task(self, task: dict) -> dict:
        if "verifier" not in task or "question" not in task:
            return make_task(task.get("where", "task"), task, self.settings) | {"id": task.get("id")}
        return task

    def first_observation(self, task: dict) -> str:
        return render_prompt(task, self.settings.template)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        observation, info = super().reset(seed=seed, options=options)
        if self.task.get("system"):
            info["system_prompt"] = self.task["system"]
        if self.task.get("history"):
            info["prompt_messages"] = [dict(m) for m in self.task["history"]]
        return observation, info

    def score(self, task: Mapping[str, Any], reply: str) -> tuple[float, dict]:
        """(reward, info) of `reply` to `task` (`score_task`)."""
        return score_task(task, reply)

    def turn_step(self, action: str) -> tuple[str, float, bool, dict]:
        reward, info = self.score(self.task, action)
        return "", reward, True, info

    def golden_reply(self, task: Mapping[str, Any]) -> str | None:
        """A reply that should score 1 on `task` (`golden_reply`), or None."""
        return golden_reply(task)

    def golden_episodes(self) -> list[tuple[dict, list[str], float]]:
        for i in range(min(self.task_source.num_tasks, 20)):
            task = self.task_source.get_task(i)
            reply = self.golden_reply(task)
            if reply is not None:
                return [(task, [reply], 1.0), (task, [""], 0.0)]
        return []

    def self_check(self) -> None:
        """The golden check of the first row with a reference reply; none (model-graded or pattern-only rows): none."""
        if self.golden_episodes():
            super().self_check()


def score_task(task: Mapping[str, Any], reply: str) -> tuple[float, dict]:
    """(reward, info) of `reply` to a task of `make_task`: its verifiers' weighted mean (`named.score`).

    info also holds each verifier's part and the model-graded verifiers left for the rewards stage."""
    specs = specs_of(task)
    scored = named.score(specs, reply, task, code_runner=run_code)
    info = scored.verdict.info()
    info["parts"] = dict(scored.parts)
    if scored.model_graded:
        info["model_graded"] = model_graded(scored, sum(s.weight for s in specs if s.name not in named.MODEL_GRADED),
                                            task)
    return scored.verdict.reward, info


def model_graded(scored: named.Scored, computed_weight: float, task: Mapping[str, Any]) -> dict:
    """What the rewards stage needs to finish a reply's score (`posttrain.rollout.rewards.Rewarder`).

    Returns {"computed_weight": the summed weight of the verifiers scored here, "parts": [{"name", "weight",
    "criteria"?: [[name, weight, description], ...] for a rubric}]}."""
    parts = []
    for s in scored.model_graded:
        part = {"name": s.name, "weight": s.weight}
        if s.name == "rubric":
            rubric = task["rubric"]
            part["criteria"] = ([["score", 1.0, rubric]] if isinstance(rubric, str) else
                                [[c["name"], float(c.get("weight", 1.0)), c["description"]] for c in rubric])
        parts.append(part)
    return {"computed_weight": float(computed_weight), "parts": parts}


def run_code(program: str, seconds: float):
    """A `code_tests` program run in the sandbox (`envs.sandbox.run`; a sandbox that cannot start: "infra_error")."""
    from envs import sandbox

    try:
        return sandbox.run(program, limits=sandbox.Limits(cpu_s=seconds, wall_s=2 * seconds))
    except RuntimeError as e:  # no bubblewrap / user namespaces: the sandbox's own one-line reason
        return sandbox.SandboxResult(status="infra_error", returncode=None, stdout="", stderr="", wall_s=0.0,
                                     cpu_s=0.0, reason=" ".join(str(e).split()))


def golden_reply(task: Mapping[str, Any]) -> str | None:
    """A reply that should score 1 on a task of `make_task` (`named.reference_reply`), or None when none exists."""
    return named.reference_reply(specs_of(task), task)


def golden_failures(tasks: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, float, str]]:
    """(id, where, reward, reason) of the rows whose reference reply scores below 1 (rows without one skipped)."""
    out = []
    for task in tasks:
        reply = golden_reply(task)
        if reply is None:
            continue
        reward, info = score_task(task, reply)
        if reward != 1.0:
            out.append((task["id"], task["where"], reward, str(info.get("reason", ""))[:200]))
    return out
