"""Per-task records on disk (records.jsonl, results.json) and their rescoring without sampling (`--from_records`)."""
from __future__ import annotations

import json
import pathlib
from typing import Mapping, Sequence

from posttrain.eval import metrics as metrics_lib
from posttrain.eval.runner import FORMATS, SCORERS

RECORDS, RESULTS = "records.jsonl", "results.json"


def write_evaluation(folder: str | pathlib.Path, records: Sequence[Mapping], results: Mapping) -> pathlib.Path:
    """Writes records.jsonl and results.json into `folder` (created); returns the folder."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RECORDS).write_text("".join(json.dumps(r, default=str) + "\n" for r in records))
    (folder / RESULTS).write_text(json.dumps(results, indent=2, default=str))
    return folder


def read_evaluation(folder: str | pathlib.Path) -> tuple[list[dict], dict]:
    """(records, results) of an evaluation folder; FileNotFoundError, or ValueError for a bad line or hash."""
    folder = pathlib.Path(folder)
    for name in (RECORDS, RESULTS):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"--from_records={folder}: no {name} (an evaluation folder written by "
                                    "posttrain eval --suite)")
    records = []
    for line_no, line in enumerate((folder / RECORDS).read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{folder / RECORDS}:{line_no} is not JSON: {e}") from None
    results = json.loads((folder / RESULTS).read_text())
    if records and results.get("task_set_hash") != metrics_lib.task_set_hash(records):
        raise ValueError(f"{folder}: results.json's task_set_hash does not match its records (edited or mixed files)")
    return records, results


def rescore(records: Sequence[Mapping], domains: Mapping[str, Mapping]) -> list[dict]:
    """The records rescored from their replies with suite.json's `domains` rows; ValueError: unknown or changed."""
    import gymnasium

    import envs  # noqa: F401  (registers the env ids)

    envs_by_domain, out = {}, []
    for r in records:
        d = r["domain"]
        if d not in domains:
            raise ValueError(f"rescore: domain {d!r} of the records is not in the suite ({sorted(domains)})")
        spec = domains[d]
        if spec["scorer"] not in SCORERS or spec["format"] not in FORMATS:
            raise ValueError(f"rescore: domain {d!r} has scorer {spec['scorer']!r} / format {spec['format']!r}; "
                             f"known: {sorted(SCORERS)} / {sorted(FORMATS)}")
        if d not in envs_by_domain:
            envs_by_domain[d] = gymnasium.make(spec["env_id"], **dict(spec["env_kwargs"])).unwrapped
        out.append(_rescore_one(envs_by_domain[d], r, spec["scorer"], spec["format"]))
    for env in envs_by_domain.values():
        env.close()
    return out


def _rescore_one(env, record: Mapping, scorer: str, fmt: str) -> dict:
    task = env.task_source.get_task(int(record["index"]))
    if json.dumps(task.get("id", record["index"])) != json.dumps(record["task_id"]):
        raise ValueError(f"rescore: {record['domain']!r} task at index {record['index']} is "
                         f"{task.get('id')!r}, the record says {record['task_id']!r}")
    turns = record.get("turns") or [[reply] for reply in record["replies"]]
    rewards, statuses, correct = [], [], []
    for texts in turns:
        reward, info = env.play(task, texts)
        rewards.append(float(reward))
        statuses.append(str(info.get("status", "")))
        correct.append(bool(SCORERS[scorer](texts[-1] if texts else "", reward, info)))
    return {**record, "rewards": rewards, "statuses": statuses, "correct": correct,
            "formatted": [FORMATS[fmt](reply) for reply in record["replies"]]}
