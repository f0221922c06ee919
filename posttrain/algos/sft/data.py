"""SFT data: TRL's record formats -> chat messages -> token ids with an assistant mask built by position; `SFTConfig`.

Shapes: the legend in `posttrain.types`. Formats and the mask rule: docs/algorithms.md.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from posttrain.errors import DataError

log = logging.getLogger(__name__)


class Example(NamedTuple):
    """One tokenized conversation or text: int32 tokens, the bool mask of trained tokens; truncated: tail cut."""

    tokens_n: np.ndarray
    assistant_n: np.ndarray
    truncated: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSettings:
    """What SFT reads (built by `posttrain.recipes.sft.make_sft_plan`).

    Attributes:
        train_path: a JSONL file of training records ("": none).
        eval_path: a JSONL file of held-out records ("": none).
        train_records: the training records inline (used when train_path is "").
        eval_records: the held-out records inline (used when eval_path is "").
        eval_fraction: share of the training records held out when no eval data is given (`split_records`).
        seq_len: L, the row width in tokens.
        rows_per_step: R, rows in one step's batch.
        packing: several conversations per row (best-fit decreasing) or one per row.
        seed: seeds the shuffles.
        from_archive: GRPO run workdirs whose archived successful episodes are the data ("": none).
        min_reward: with from_archive, the reward an episode needs to be trained on.
        max_per_prompt: with from_archive, distinct successful replies kept per prompt.
    """

    train_path: str = ""
    eval_path: str = ""
    train_records: tuple[Mapping[str, Any], ...] = ()
    eval_records: tuple[Mapping[str, Any], ...] = ()
    eval_fraction: float = 0.0
    seq_len: int = 512
    rows_per_step: int = 8
    packing: bool = True
    seed: int = 0
    from_archive: str = ""
    min_reward: float = 1.0
    max_per_prompt: int = 1


def read_jsonl(path: str | pathlib.Path) -> list[tuple[str, dict]]:
    """[(where "path:line", record)] of a UTF-8 JSONL file; DataError for no file, or a line not a JSON object."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise DataError(f"data file {str(path)!r} is a directory; give a JSONL file")
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    out = []
    with path.open("rb") as fh:
        for i, raw in enumerate(fh, 1):
            where = f"{path}:{i}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}): {line.strip()[:80]!r}") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            out.append((where, record))
    return out


def _check_messages(messages: Any, where: str, key: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{'role', 'content'}} objects, got "
                         f"{type(messages).__name__}")
    for j, m in enumerate(messages):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: {key}[{j}] must be an object with string 'role' and 'content', got {m!r:.80}")
    return [dict(m) for m in messages]


def as_turns(value: Any, where: str, key: str, role: str) -> list[dict]:
    """The chat messages of one record field (a string: one message of `role`); DataError for malformed ones."""
    return [{"role": role, "content": value}] if isinstance(value, str) else _check_messages(value, where, key)


def to_messages(record: Mapping[str, Any], where: str) -> tuple[list[dict], tuple[int, ...]]:
    """(messages, indices of the trained assistant turns) of one chat record; DataError naming `where` if malformed."""
    if "messages" in record:
        messages = _check_messages(record["messages"], where, "messages")
        trained = tuple(i for i, m in enumerate(messages) if m["role"] == "assistant")
    elif "prompt" in record and "completion" in record:
        prompt = as_turns(record["prompt"], where, "prompt", "user")
        completion = as_turns(record["completion"], where, "completion", "assistant")
        messages = prompt + completion
        trained = tuple(len(prompt) + i for i, m in enumerate(completion) if m["role"] == "assistant")
    else:
        missing = [k for k in ("prompt", "completion") if k not in record]
        raise DataError(f"{where}: missing key {' and '.join(map(repr, missing))}: a record needs 'messages', "
                         f"'prompt' and 'completion', or 'text'; it has {sorted(record)}")
    if not trained:
        raise DataError(f"{where}: no assistant turn to train on (roles {[m['role'] for m in messages]})")
    if trained[0] == 0:
        raise DataError(f"{where}: the first message is an assistant turn: nothing precedes it to condition on")
    return messages, trained


def assistant_spans(tokenizer, messages: Sequence[Mapping], trained: Iterable[int], where: str):
    """(full rendering, character spans of the trained turns); DataError for a template not prefix-stable here."""
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, add_generation_prompt=gen)
    full = render(messages, False)
    spans = []
    for i in trained:
        prefix, upto = render(messages[:i], True), render(messages[:i + 1], False)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise DataError(f"{where}: the chat template does not render turn {i} after the conversation before "
                             "it (its prefixes are not prefixes of the full rendering), so the assistant tokens "
                             "cannot be located by position")
        spans.append((len(prefix), len(upto.rstrip())))
    return full, spans


def encode(tokenizer, messages: Sequence[Mapping], trained: Iterable[int], where: str,
           max_len: int | None = None) -> Example:
    """The `Example` of a conversation: template tokens, assistant mask by position (DataError: `assistant_spans`)."""
    full, spans = assistant_spans(tokenizer, messages, trained, where)
    enc = tokenizer.backend.encode(full, add_special_tokens=False)
    starts = np.asarray([s for s, _ in enc.offsets], np.int64)
    mask = np.zeros(len(enc.ids), bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    tokens = np.asarray(enc.ids, np.int32)
    cut = max_len is not None and len(tokens) > max_len
    if cut:
        tokens, mask = tokens[:max_len], mask[:max_len]
    return Example(tokens, mask, bool(cut))


def encode_text(tokenizer, text: Any, where: str, max_len: int | None = None) -> Example:
    """The `Example` of a "text" record, every token trained (EOS appended unless last); DataError for an empty text."""
    if not isinstance(text, str) or not text:
        raise DataError(f"{where}: 'text' must be a non-empty string, got {text!r:.80}")
    ids = tokenizer.encode(text, add_special_tokens=True)
    if not ids or ids[-1] != tokenizer.eos_id:
        ids = [*ids, tokenizer.eos_id]
    tokens = np.asarray(ids, np.int32)
    cut = max_len is not None and len(tokens) > max_len
    if cut:
        tokens = tokens[:max_len]
    return Example(tokens, np.ones(len(tokens), bool), bool(cut))


def encode_record(tokenizer, record: Mapping[str, Any], where: str, max_len: int | None = None) -> Example:
    """The `Example` of one record ('text' alone: `encode_text`, else the chat template); DataError for a bad one."""
    if "text" in record and "messages" not in record and "prompt" not in record:
        return encode_text(tokenizer, record["text"], where, max_len)
    return encode(tokenizer, *to_messages(record, where), where, max_len)


def load_records(path: str, records: Sequence[Mapping[str, Any]], name: str) -> list[tuple[str, Mapping]]:
    """[(where, record)] from a JSONL `path`, else from inline `records` (where = "<name>[i]")."""
    if path:
        return read_jsonl(path)
    return [(f"{name}[{i}]", r) for i, r in enumerate(records)]


def tokenize(tokenizer, records: Sequence[tuple[str, Mapping]], max_len: int) -> tuple[list[Example], dict]:
    """(examples cut to `max_len`, counts); drops those left with no trained token; TypeError for a non-mapping."""
    examples, truncated, dropped = [], 0, 0
    for where, record in records:
        if not isinstance(record, Mapping):
            raise TypeError(f"{where}: an SFT record must be a mapping, got {type(record).__name__}")
        ex = encode_record(tokenizer, record, where, max_len)
        if not ex.assistant_n[1:].any():  # token 0 has no position before it to predict it from
            dropped += 1
            continue
        truncated += ex.truncated
        examples.append(ex)
    if dropped:
        log.warning("%d of %d conversations dropped: no assistant token within the first %d tokens (seq_len)",
                    dropped, len(records), max_len)
    return examples, {"sft/examples": len(examples), "sft/truncated": truncated, "sft/dropped": dropped}


def split_records(records: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out): a seeded shuffle's last ceil(fraction * n) records held out (none for fraction 0)."""
    if not fraction:
        return list(records), []
    order = np.random.default_rng(seed).permutation(len(records))
    k = int(np.ceil(fraction * len(records)))
    keep = sorted(order[:len(records) - k])
    held = sorted(order[len(records) - k:])
    return [records[i] for i in keep], [records[i] for i in held]


def load_datasets(settings: DataSettings, tokenizer) -> tuple[list[Example], list[Example], dict]:
    """(train examples, held-out examples, counts) of the settings' data; DataError when no training example is left."""
    train = load_records(settings.train_path, settings.train_records, "train_examples")
    held = load_records(settings.eval_path, settings.eval_records, "eval_examples")
    if not held and settings.eval_fraction:
        train, held = split_records(train, settings.eval_fraction, settings.seed)
    train_ex, counts = tokenize(tokenizer, train, settings.seq_len)
    eval_ex, eval_counts = tokenize(tokenizer, held, settings.seq_len)
    if not train_ex:
        raise DataError(f"no SFT training example with an assistant token within seq_len={settings.seq_len} "
                         f"(records: {len(train)}, from {settings.train_path or 'train_examples'})")
    counts.update({f"{k}_eval": v for k, v in eval_counts.items()})
    return train_ex, eval_ex, counts


def offline_checks(section) -> dict[str, bool]:
    """{what must hold: whether it does} for the fields every offline section has (SFTConfig, DPOConfig)."""
    s = section
    return {"num_microbatches (>= 1)": s.num_microbatches >= 1, "logprob_chunk (>= 1)": s.logprob_chunk >= 1,
            "eval_fraction (in [0, 1))": 0.0 <= s.eval_fraction < 1.0,
            "train_path / train_examples / from_archive (at most one)":
                sum(map(bool, (s.train_path, s.train_examples, s.from_archive))) <= 1,
            "eval_path / eval_examples (at most one)": not (s.eval_path and s.eval_examples)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """The `sft` section: data in TRL's formats (at most one source) and the training settings.

    Attributes:
        train_path: a JSONL file of training records ("": none).
        train_examples: the training records inline (for tiny runs and tests).
        eval_path: a JSONL file of held-out records ("": none).
        eval_examples: the held-out records inline.
        eval_fraction: share of the training records held out when no eval data is given (in [0, 1)); with
            from_archive, of its prompts, and 0 holds out `from_archive.ARCHIVE_EVAL_FRACTION` (0.1) of them.
        seq_len: the longest row in tokens, >= 2 (longer conversations are cut; batches are sized by the data).
        rows_per_step: rows in a step's batch (a multiple of num_microbatches x the mesh's batch shards).
        packing: several conversations per row (best-fit decreasing, segment ids) or one per row.
        num_microbatches: gradient-accumulation microbatches.
        logprob_chunk: slots per unembedding chunk.
        moe_aux_coef: MoE load-balance coefficient (< 0: the model's own).
        eval_at_start: held-out NLL and perplexity before the first step.
        eval_at_end: held-out NLL and perplexity after the last step.
        from_archive: GRPO run workdirs, comma-separated: train on their archived successful episodes ("": not used).
        min_reward: with from_archive, an episode is successful when its reward is >= this (and its status ok).
        max_per_prompt: with from_archive, at most this many distinct successful replies per prompt (>= 1).
    """

    train_path: str = ""
    train_examples: tuple[Mapping[str, Any], ...] = ()
    eval_path: str = ""
    eval_examples: tuple[Mapping[str, Any], ...] = ()
    eval_fraction: float = 0.0
    seq_len: int = 512
    rows_per_step: int = 8
    packing: bool = True
    num_microbatches: int = 1
    logprob_chunk: int = 256
    moe_aux_coef: float = -1.0
    eval_at_start: bool = True
    eval_at_end: bool = True
    from_archive: str = ""
    min_reward: float = 1.0
    max_per_prompt: int = 1

    def __post_init__(self):
        checks = {"seq_len (>= 2)": self.seq_len >= 2, "rows_per_step (>= 1)": self.rows_per_step >= 1,
                  "max_per_prompt (>= 1)": self.max_per_prompt >= 1,
                  **offline_checks(self)}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid {', '.join(bad)} in sft: seq_len={self.seq_len}, rows_per_step="
                             f"{self.rows_per_step}, num_microbatches={self.num_microbatches}, logprob_chunk="
                             f"{self.logprob_chunk}, eval_fraction={self.eval_fraction}, train_path="
                             f"{self.train_path!r}, train_examples: {len(self.train_examples)}, eval_path="
                             f"{self.eval_path!r}, eval_examples: {len(self.eval_examples)}")
