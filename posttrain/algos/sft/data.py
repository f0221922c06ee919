"""SFT data: TRL's record formats -> chat messages -> token ids with an assistant mask built by position.

Dimension legend:
  n  tokens of one rendered conversation

Record formats (one JSON object per line of a JSONL file, or the same dicts inline; as TRL's SFTTrainer reads them,
https://huggingface.co/docs/trl/dataset_formats):
  {"messages": [{"role": "system" | "user" | "assistant" | ..., "content": str}, ...]}   (conversational)
      every assistant turn is trained;
  {"prompt": str | [messages], "completion": str | [messages]}   (prompt-completion)
      only the completion's assistant turns are trained. A string prompt is one user turn and a string completion
      one assistant turn: both go through the chat template (TRL would concatenate plain strings untemplated; this
      library trains chat models, so a plain pair is a one-turn chat).
  {"text": str}   (language modeling)
      no chat template: the text's tokens (with the special tokens the tokenizer's post-processor adds, and EOS
      appended unless the text already ends with it, as TRL does) are all trained.

The mask is built by POSITION (docs/design.md invariant 2), never by token value: for the assistant turn i the chat
template renders the conversation up to it with the generation prompt (`prefix`) and up to and including it
(`upto`); the characters [len(prefix), len(upto.rstrip())) of the full rendering are the turn (its content and the
template's end-of-turn token, not the whitespace the template writes after it), and a token is an assistant token
iff its first character lies in such a span (the tokenizer's character offsets). A template that does not render a
conversation's prefixes as prefixes of its full rendering (e.g. one that drops earlier reasoning) is refused with a
DataError rather than masked wrongly.
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
    """One tokenized conversation or text. tokens_n: int32 ids of the full chat-template rendering (a "text"
    record: of the text); assistant_n: bool, True on the tokens the loss trains (assistant turns, their end-of-turn
    token included; every token of a text); truncated: the rendering was longer than the row width and its tail
    was cut."""

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
        eval_fraction: share of the training records held out when no eval data is given (the last ones after a
            seeded shuffle).
        seq_len: L, the row width in tokens.
        rows_per_step: R, rows in one step's batch.
        packing: several conversations per row (best-fit decreasing) or one per row.
        seed: seeds the shuffles.
        from_archive: a GRPO run's workdir whose archived successful episodes are the data instead ("": none;
            `posttrain.algos.from_archive.sft_examples`, read by `recipes.sft`).
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
    """[(where, record)] of a JSONL file (UTF-8), `where` = "path:line" (1-based; blank lines skipped).

    Raises DataError naming the path for a missing file or a directory, and path:line for a line that is not
    UTF-8, not JSON or not an object."""
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
    """The chat messages of one record field: a string is one message of `role`, a list is checked as messages
    (each a mapping with string 'role' and 'content'; copied). Raises DataError naming `where` and `key` for an
    empty list, a non-list, or a malformed message."""
    return [{"role": role, "content": value}] if isinstance(value, str) else _check_messages(value, where, key)


def to_messages(record: Mapping[str, Any], where: str) -> tuple[list[dict], tuple[int, ...]]:
    """(messages, indices of the trained assistant turns) of one record in a TRL format (see the module doc).

    Raises DataError naming `where` for a record with neither `messages` nor `prompt` + `completion`, malformed
    messages, or no assistant turn to train."""
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
    """(full rendering, [(start, end)] character spans of the trained turns) under the tokenizer's chat template.

    Raises DataError naming `where` when the template is not prefix-stable on this conversation."""
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
    """The `Example` of one conversation: its chat-template tokens (no special tokens added beyond the
    template's) and the assistant mask by position (module doc), cut to `max_len` tokens when given.

    Raises DataError naming `where` (see `assistant_spans`)."""
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
    """The `Example` of a language-modeling record's text: its tokens with the special tokens the tokenizer's
    post-processor adds (e.g. BOS), EOS appended unless already last (TRL's SFTTrainer on a "text" dataset), every
    token trained; cut to `max_len` tokens when given. Raises DataError naming `where` for a text that is not a
    non-empty string."""
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
    """The `Example` of one record in any format of the module doc: a record with 'text' and neither 'messages'
    nor 'prompt' is language modeling (`encode_text`), any other goes through the chat template (`to_messages`,
    `encode`). Raises DataError naming `where` for a malformed record."""
    if "text" in record and "messages" not in record and "prompt" not in record:
        return encode_text(tokenizer, record["text"], where, max_len)
    return encode(tokenizer, *to_messages(record, where), where, max_len)


def load_records(path: str, records: Sequence[Mapping[str, Any]], name: str) -> list[tuple[str, Mapping]]:
    """[(where, record)] from a JSONL `path`, else from inline `records` (where = "<name>[i]")."""
    if path:
        return read_jsonl(path)
    return [(f"{name}[{i}]", r) for i, r in enumerate(records)]


def tokenize(tokenizer, records: Sequence[tuple[str, Mapping]], max_len: int) -> tuple[list[Example], dict]:
    """Examples of (where, record) pairs cut to `max_len` tokens, and counts {"sft/examples", "sft/truncated",
    "sft/dropped"}: a conversation left with no trained token after the cut is dropped (its assistant turn starts
    past max_len). Raises DataError naming the record for a malformed one (`encode_record`); TypeError
    for a record that is not a mapping."""
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
    """(train examples, held-out examples, counts) of the settings' data. Raises DataError when no training
    record is left, and as `tokenize` / `read_jsonl` do."""
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
    """The `sft` section. Data in TRL's formats (`posttrain.algos.sft.data`): `train_path` or `train_examples`,
    exactly one of them; held-out data likewise from `eval_path` / `eval_examples`, or else the `eval_fraction` of
    the training records.

    Attributes:
        train_path: a JSONL file of training records ("": none).
        train_examples: the training records inline (for tiny runs and tests).
        eval_path: a JSONL file of held-out records ("": none).
        eval_examples: the held-out records inline.
        eval_fraction: share of the training records held out when no eval data is given (in [0, 1)).
        seq_len: the longest row in tokens (conversations longer than it are cut; >= 2). A run's batches are as
            wide as its longest packed row, rounded up to 16 (`algos.sft.packing.batch_shape`), not seq_len.
        rows_per_step: rows in a step's batch (a multiple of num_microbatches x the mesh's batch shards).
        packing: several conversations per row (best-fit decreasing, segment ids) or one per row.
        num_microbatches: gradient-accumulation microbatches.
        logprob_chunk: slots per unembedding chunk.
        moe_aux_coef: MoE load-balance coefficient (< 0: the model's own).
        eval_at_start: held-out NLL and perplexity before the first step.
        eval_at_end: held-out NLL and perplexity after the last step.
        from_archive: a GRPO run's workdir, or several separated by commas (`algos.from_archive.archive_runs`): train
            on their archived successful episodes instead of train_path /
            train_examples (rejection-sampling fine-tuning, `posttrain.algos.from_archive.sft_examples`; held out:
            eval_fraction of its prompts). "": not used.
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
