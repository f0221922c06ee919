"""`posttrain tasks check|export`: task files checked before training, and archived episodes written as task files.

  posttrain tasks check FILE [FILE ...] [--suite=configs/eval/default.py[,SUITE2]] [--verifier=NAME|JSON]
                   [--answer_after=MARK] [--fields=prompt=question,answer=answer] [--json] [--model=PATH]
                   (schema, golden answers, gaming floor, duplicates, contamination with the suites and the other
                   files, prompt token lengths; exit 1 when a check fails: it can guard a launch)
  posttrain tasks export --from_archive=RUN --out=FILE.jsonl [--domains=PATTERNS] [--status=ok] [--min_reward=R]
                   [--steps=A:B]   (archived episodes as task file rows: prompt, answer, domain, reward)
"""
from __future__ import annotations

import difflib
import fnmatch
import json
import os
import sys

from posttrain.cli.commands import UsageError

VERBS = ("check", "export")


def cmd_tasks(f, args) -> int:
    """`posttrain tasks <verb> ...`; `args`: the positional arguments after the command."""
    if not args or args[0] not in VERBS:
        close = difflib.get_close_matches(args[0], VERBS, n=1) if args else []
        got = f"; {args[0]!r} is none of them" + (f" (did you mean {close[0]!r}?)" if close else "") if args else ""
        raise UsageError(f"posttrain tasks needs a verb, one of {list(VERBS)}{got}: posttrain tasks check FILE..., "
                         "posttrain tasks export --from_archive=RUN --out=FILE.jsonl")
    verb, rest = args[0], list(args[1:])
    if verb == "check":
        return _check(f, rest)
    if rest:
        raise UsageError(f"posttrain tasks export takes no positional arguments, got {rest}")
    return _export(f)


def _settings(f) -> dict:
    """The task-file settings the flags give (--verifier, --answer_after, --fields)."""
    out = {}
    if f.verifier:
        text = f.verifier.strip()
        try:
            out["verifier"] = json.loads(text) if text[:1] in "[{" else text
        except json.JSONDecodeError as e:
            raise UsageError(f"--verifier={f.verifier}: not a name or JSON ({e.msg})") from None
    if f.answer_after:
        out["answer_after"] = f.answer_after
    if f.fields:
        pairs = [p.partition("=") for p in f.fields.split(",") if p.strip()]
        if not pairs or any(not k.strip() or not v.strip() or eq != "=" for k, eq, v in pairs):
            raise UsageError(f"--fields={f.fields}: expected task_field=column pairs, e.g. prompt=question,answer=ans")
        out["fields"] = {k.strip(): v.strip() for k, _, v in pairs}
    return out


def _tokenizer(model: str | None):
    """The policy tokenizer for prompt lengths: --model's (a .gguf file or HF directory), else SmolLM2's; None when
    the default model is not installed."""
    from posttrain.checkpoints.gguf import default_model_path, read_gguf_metadata
    from posttrain.model.tokenizer import Tokenizer

    try:
        path = model or str(default_model_path())
    except (FileNotFoundError, ImportError):
        return None
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    if not os.path.isfile(path):
        raise UsageError(f"--model={path}: no such file or directory")
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(path))


def _check(f, files) -> int:
    from envs.tasks import task_check, task_file
    from posttrain.eval import suite as suite_lib

    if not files:
        raise UsageError("posttrain tasks check needs at least one task file: posttrain tasks check FILE [FILE ...]")
    reference = {}
    for path in [p.strip() for p in (f.suite or "").split(",") if p.strip()]:
        try:
            reference.update(suite_lib.suite_prompts(suite_lib.load_suite(path)))
        except ValueError as e:
            raise UsageError(f"--suite={path}: {' '.join(str(e).split())}") from None
    try:
        reports = task_check.check_files(files, reference=reference, tokenizer=_tokenizer(f.model),
                                         **_settings(f))
    except task_file.TaskFileError as e:
        raise UsageError(" ".join(str(e).split())) from None
    except ValueError as e:  # settings the flags gave
        raise UsageError(" ".join(str(e).split())) from None
    print(task_check.dumps(reports) if f.json else task_check.format_report(reports))
    return 0 if all(r.ok for r in reports) else 1


def _steps(text: str | None) -> tuple[int | None, int | None]:
    if not text:
        return None, None
    a, colon, b = text.partition(":")
    try:
        lo = int(a) if a.strip() else None
        hi = int(b) if b.strip() else None if colon else lo
    except ValueError:
        raise UsageError(f"--steps={text}: expected A:B, A: or :B (archive steps, inclusive)") from None
    return lo, hi


def _export(f) -> int:
    from posttrain.config.load import config_for_run
    from posttrain.rollout.env_side import task_sources
    from posttrain.scheduling import archive

    if not f.from_archive or not f.out:
        raise UsageError("posttrain tasks export needs --from_archive=RUN and --out=FILE.jsonl")
    if not f.out.endswith((".jsonl", ".json", ".ndjson")):
        raise UsageError(f"--out={f.out}: the export is JSONL (name it .jsonl)")
    lo, hi = _steps(f.steps)
    patterns = [p.strip() for p in (f.domains or "").split(",") if p.strip()]
    statuses = [s.strip() for s in (f.status or "").split(",") if s.strip()]
    from envs.verify.answers import STATUSES

    unknown = sorted(set(statuses) - set(STATUSES))
    if unknown:
        raise UsageError(f"--status={f.status}: {unknown} are no episode statuses; statuses: {', '.join(STATUSES)}")
    rows: dict[tuple, dict] = {}
    for run in [r.strip() for r in f.from_archive.split(",") if r.strip()]:
        if not archive.step_files(run):
            what = "no such directory" if not os.path.isdir(run) else f"no episode archive ({archive.archive_dir(run)})"
            raise UsageError(f"--from_archive={run}: {what}; it names the workdir of a GRPO run")
        specs = config_for_run(run).env.train
        sources = {}
        for r in archive.read(run, status=statuses or None).to_pylist():
            if patterns and not any(fnmatch.fnmatchcase(r["domain"], p) for p in patterns):
                continue
            if (lo is not None and r["step"] < lo) or (hi is not None and r["step"] > hi):
                continue
            if f.min_reward is not None and (r["reward"] is None or r["reward"] < f.min_reward):
                continue
            if r["domain"] not in specs:
                continue
            if r["domain"] not in sources:
                sources.update(task_sources({r["domain"]: specs[r["domain"]]}))
            key = (run, r["domain"], r["task_index"])
            if key not in rows:
                env_id, _, source = sources[r["domain"]]
                rows[key] = export_row(run, r["domain"], env_id, source.get_task(int(r["task_index"])))
            meta = rows[key]["metadata"]
            meta["episodes"] += 1
            meta["rewards"].append(r["reward"])
            if r["reward"] is not None and (meta["best_reward"] is None or r["reward"] > meta["best_reward"]):
                meta["best_reward"], meta["best_reply"] = r["reward"], r["completion"]
    if not rows:
        raise UsageError(f"--from_archive={f.from_archive}: no archived episode matches the filters "
                         f"(domains={f.domains!r}, status={f.status!r}, min_reward={f.min_reward}, steps={f.steps!r})")
    os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
    tmp = f.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows.values())
    os.replace(tmp, f.out)
    print(f"wrote {len(rows)} rows to {f.out}", file=sys.stderr)
    return 0


def export_row(run: str, domain: str, env_id: str, task: dict) -> dict:
    """A task file row of one archived task: its prompt and reference answer as the env holds them.

    Task-file rows keep their verifiers; another env's answer is checked by `math`. metadata collects the run's
    episodes of the task (the caller fills episodes, rewards, best_reward and best_reply)."""
    from envs.tasks.task_file import ENV_ID

    prompt = task.get("question") if isinstance(task.get("question"), str) else task.get("prompt")
    if env_id == ENV_ID and (task.get("history") or task.get("system")):
        prompt = [*([{"role": "system", "content": task["system"]}] if task.get("system") else []),
                  *task.get("history", ()), {"role": "user", "content": task["question"]}]
    row = {"id": f"{domain}/{task.get('id', '')}", "prompt": prompt}
    if task.get("answer") is not None:
        row["answer"] = task["answer"]
    if env_id == ENV_ID:
        row["verifier"] = [{"name": s["name"], **s["args"], "weight": s["weight"]} for s in task["verifier"]]
        internal = {"where", "id", "question", "history", "system", "verifier", "split", "answer", "prompt"}
        row.update({k: v for k, v in task.items() if k not in internal})  # the row's own fields (a template's too)
    elif "answer" in row:
        row["verifier"] = "math"
    row["metadata"] = {"run": run, "domain": domain, "env": env_id, "task_id": task.get("id"), "episodes": 0,
                       "rewards": [], "best_reward": None, "best_reply": None}
    return row
