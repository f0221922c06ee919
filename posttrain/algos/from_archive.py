"""Offline training data from GRPO runs' episode archives (`posttrain.scheduling.archive`): SFT examples, DPO pairs.

Shapes: the legend in `posttrain.types`. The rows used and the split by prompt: docs/algorithms.md.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import numpy as np
import pyarrow as pa

from posttrain.algos.dpo.data import Pair
from posttrain.algos.sft.data import Example, split_records
from posttrain.scheduling import archive

COLUMNS = ("episode_id", "attempt", "run", "domain", "task_index", "visit", "sample", "step", "policy_version",
           "prompt_ids", "completion_ids", "reward", "status", "details")


def usable_rows(table: pa.Table) -> tuple[list[dict], dict[str, int]]:
    """(rows in archive order, counts): rows with a reward, one turn, a training task; ValueError: not an archive."""
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"not an episode archive table: missing columns {missing}")
    rows = sorted(table.select(list(COLUMNS)).to_pylist(), key=lambda r: (r["step"], r["episode_id"], r["attempt"]))
    kept, counts = [], {"archive/rows": len(rows), "archive/no_reward": 0, "archive/multi_turn": 0,
                        "archive/not_train_split": 0}
    for r in rows:
        details = json.loads(r["details"] or "{}")
        if r["reward"] is None:
            counts["archive/no_reward"] += 1
        elif int(details.get("turns", 1)) > 1:
            counts["archive/multi_turn"] += 1
        elif details.get("split", "train") != "train":
            counts["archive/not_train_split"] += 1
        elif r["prompt_ids"] and r["completion_ids"]:
            kept.append(r)
    return kept, counts


ARCHIVE_EVAL_FRACTION = 0.1  # the share of an archive's prompts held out when the section sets no eval_fraction


def split_prompts(keys: list, eval_fraction: float, seed: int) -> tuple[set, set]:
    """(train keys, held-out keys): `eval_fraction` of the distinct keys, held out by a seeded shuffle.

    A single prompt is never held out (nothing would be left to train on)."""
    distinct = list(OrderedDict.fromkeys(keys))
    if len(distinct) < 2:
        return set(distinct), set()
    train, held = split_records(distinct, eval_fraction, seed)
    return set(train), set(held)


def _example(prompt: list[int], reply: list[int], max_len: int) -> Example:
    tokens = np.asarray(prompt + reply, np.int32)
    mask = np.zeros(len(tokens), bool)
    mask[len(prompt):] = True
    cut = len(tokens) > max_len
    return Example(tokens[:max_len], mask[:max_len], bool(cut))


def sft_examples(table: pa.Table, *, min_reward: float = 1.0, max_per_prompt: int = 1, max_len: int = 512,
                 eval_fraction: float = 0.0, seed: int = 0) -> tuple[list[Example], list[Example], dict]:
    """(train, held-out, counts): distinct successful replies as `Example`s; ValueError for bad limits."""
    if max_per_prompt < 1 or max_len < 2:
        raise ValueError(f"sft_examples: max_per_prompt must be >= 1 and max_len >= 2, got {max_per_prompt}, "
                         f"{max_len}")
    rows, counts = usable_rows(table)
    good = [r for r in rows if r["status"] == "ok" and r["reward"] >= min_reward]
    by_prompt: dict[tuple, list[tuple]] = OrderedDict()
    dup = over = 0
    for r in good:
        replies = by_prompt.setdefault(tuple(r["prompt_ids"]), [])
        reply = tuple(r["completion_ids"])
        if reply in replies:
            dup += 1
        elif len(replies) >= max_per_prompt:
            over += 1
        else:
            replies.append(reply)
    train_keys, _ = split_prompts(list(by_prompt), eval_fraction, seed)
    out: dict[bool, list[Example]] = {True: [], False: []}
    truncated = dropped = 0
    for prompt, replies in by_prompt.items():
        for reply in replies:
            ex = _example(list(prompt), list(reply), max_len)
            if not ex.assistant_n[1:].any():
                dropped += 1
                continue
            truncated += ex.truncated
            out[prompt in train_keys].append(ex)
    counts.update({"archive/successful": len(good), "archive/prompts": len(by_prompt),
                   "archive/duplicate_replies": dup, "archive/over_max_per_prompt": over,
                   "sft/examples": len(out[True]), "sft/examples_eval": len(out[False]), "sft/truncated": truncated,
                   "sft/dropped": dropped})
    return out[True], out[False], counts


def _group_key(r: dict) -> tuple:
    return r["run"], r["domain"], r["task_index"], r["visit"], r["policy_version"], tuple(r["prompt_ids"])


def group_pairs(rows: list[dict], max_pairs_per_group: int = 1) -> list[tuple[dict, dict]]:
    """[(chosen row, rejected row)]: per group (`_group_key`), distinct replies scored 1 and 0, in sample order."""
    groups: dict[tuple, dict[float, list[dict]]] = OrderedDict()
    for r in rows:
        if r["reward"] in (0.0, 1.0):
            side = groups.setdefault(_group_key(r), {1.0: [], 0.0: []})[r["reward"]]
            if all(tuple(s["completion_ids"]) != tuple(r["completion_ids"]) for s in side):
                side.append(r)
    pairs = []
    for sides in groups.values():
        chosen, rejected = (sorted(sides[v], key=lambda r: (r["sample"], r["attempt"])) for v in (1.0, 0.0))
        pairs.extend(list(zip(chosen, rejected))[:max_pairs_per_group])
    return pairs


def dpo_pairs(table: pa.Table, *, max_prompt_len: int = 256, max_completion_len: int = 256,
              max_pairs_per_group: int = 1, eval_fraction: float = 0.0,
              seed: int = 0) -> tuple[list[Pair], list[Pair], dict[str, Any]]:
    """(train, held-out, counts) of the archive's pairs, pair_id "<chosen id>#<attempt>|<rejected id>#<attempt>"."""
    rows, counts = usable_rows(table)
    chosen_rejected = group_pairs(rows, max_pairs_per_group)
    train_keys, _ = split_prompts([tuple(c["prompt_ids"]) for c, _ in chosen_rejected], eval_fraction, seed)
    out: dict[bool, list[Pair]] = {True: [], False: []}
    for c, r in chosen_rejected:
        prompt = np.asarray(c["prompt_ids"], np.int32)
        replies = [np.asarray(x["completion_ids"], np.int32) for x in (c, r)]
        cut = len(prompt) > max_prompt_len or any(len(x) > max_completion_len for x in replies)
        pair_id = f"{c['episode_id']}#{c['attempt']}|{r['episode_id']}#{r['attempt']}"
        out[tuple(c["prompt_ids"]) in train_keys].append(
            Pair(pair_id, prompt[-max_prompt_len:], replies[0][:max_completion_len],
                 replies[1][:max_completion_len], bool(cut)))
    counts.update({"archive/groups_with_pair": len({_group_key(c) for c, _ in chosen_rejected}),
                   "dpo/train_pairs": len(out[True]), "dpo/eval_pairs": len(out[False])})
    return out[True], out[False], counts


def archive_table(runs):
    """The archives of the runs `runs` names, concatenated; FileNotFoundError if one lacks it, ValueError on a clash."""
    import pyarrow as pa

    tables, owner = [], {}
    for run in archive_runs(str(runs)):
        if not archive.step_files(run):
            raise FileNotFoundError(f"{str(run)!r} has no episode archive ({archive.archive_dir(run)} holds no "
                                    "step_*.parquet file): from_archive takes the workdir of a GRPO run")
        table = archive.read(run)
        for name in set(table.column("run").to_pylist()):
            if name in owner:
                raise ValueError(f"the archives of {owner[name]!r} and {str(run)!r} both hold run {name!r}: their "
                                 "episodes would be taken for one run's (rename a workdir and rerun it, or use one)")
            owner[name] = str(run)
        tables.append(table)
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def archive_runs(spec: str) -> list[str]:
    """The run directories of a `from_archive` value: comma-separated workdirs, in order, blanks dropped."""
    return [r.strip() for r in spec.split(",") if r.strip()]
