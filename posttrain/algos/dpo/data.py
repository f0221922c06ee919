"""DPO data: TRL's preference records -> token ids -> `PairBatch`es in the packed group layout; the `dpo` config.

Shapes: the legend in `posttrain.types`. Record format and layout: docs/algorithms.md.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
from flax import struct

from posttrain.errors import DataError
from posttrain.algos.dpo.losses import LOSSES
from posttrain.algos.sft.data import as_turns, load_records, offline_checks, split_records
from posttrain.rollout import batching
from posttrain.rollout.episodes import Sample
from posttrain.types import RolloutBatch

LOSS_NAMES = tuple(LOSSES)  # `dpo.loss`

log = logging.getLogger(__name__)
ALIGN = 8  # prompt and reply regions are rounded up to a multiple of this many tokens


@struct.dataclass
class PairBatch(RolloutBatch):
    """A `RolloutBatch` of pairs (samples 2p chosen, 2p + 1 rejected); ref_logp_N: float32 reference sums, nats."""

    ref_logp_N: Any = None


class Pair(NamedTuple):
    """One tokenized preference pair (int32 ids); truncated: the prompt or a reply was cut to its maximum."""

    pair_id: str
    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray
    truncated: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairSettings:
    """The pair data a run reads (`posttrain.recipes.dpo.pair_settings` builds it).

    Attributes:
      train_path: a JSONL file of preference records ("": `train_records`).
      eval_path: held-out records as JSONL ("": `eval_records`, else `eval_fraction`).
      train_records: inline records, used when `train_path` is "".
      eval_records: inline held-out records.
      eval_fraction: share of the training records held out when no eval data is given.
      max_prompt_len: tokens; a longer prompt keeps its LAST tokens (TRL's keep_end).
      max_completion_len: tokens; a longer reply keeps its first tokens.
      pairs_per_step: P, pairs in one step's batch.
      seed: of the shuffles (held-out split, step order).
      from_archive: GRPO run workdirs whose archived groups give the pairs ("": none; `from_archive.dpo_pairs`).
    """

    train_path: str = ""
    eval_path: str = ""
    train_records: tuple[Mapping[str, Any], ...] = ()
    eval_records: tuple[Mapping[str, Any], ...] = ()
    eval_fraction: float = 0.0
    max_prompt_len: int = 256
    max_completion_len: int = 256
    pairs_per_step: int = 8
    seed: int = 0
    from_archive: str = ""


def _reply(value: Any, where: str, key: str) -> dict:
    turns = as_turns(value, where, key, "assistant")
    if len(turns) != 1 or turns[0]["role"] != "assistant":
        raise DataError(f"{where}: {key!r} must be one assistant turn (a string or a one-message list), got roles "
                         f"{[t['role'] for t in turns]}")
    return turns[0]


def split_implicit_prompt(record: Mapping[str, Any], where: str) -> dict:
    """`record` with "prompt": the messages both conversations begin with (none: DataError), each reply the rest."""
    chosen, rejected = (as_turns(record[k], where, k, "assistant") for k in ("chosen", "rejected"))
    if isinstance(record["chosen"], str) or isinstance(record["rejected"], str):
        raise DataError(f"{where}: missing key(s) ['prompt']: string replies need a 'prompt' (only message-list "
                        "replies carry their own)")
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise DataError(f"{where}: missing key(s) ['prompt'], and 'chosen' and 'rejected' do not begin with the "
                        "same messages, so no prompt can be taken from them")
    return {**record, "prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def encode_pair(tokenizer, record: Mapping[str, Any], where: str, max_prompt_len: int,
                max_completion_len: int) -> Pair:
    """The `Pair` of one record, each reply tokenized after the rendered prompt; DataError naming `where` if bad."""
    if not isinstance(record, Mapping):
        raise TypeError(f"{where}: a DPO record must be a mapping, got {type(record).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise DataError(f"{where}: missing key(s) {missing}: a preference record needs 'chosen' and 'rejected' "
                        f"(and 'prompt', unless both are conversations that begin with it); it has {sorted(record)}")
    if "prompt" not in record:
        record = split_implicit_prompt(record, where)
    prompt = as_turns(record["prompt"], where, "prompt", "user")
    if prompt[-1]["role"] == "assistant":
        raise DataError(f"{where}: the prompt ends with an assistant turn; the replies are the assistant's turn")
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, add_generation_prompt=gen)
    head = render(prompt, True)
    replies, cut = [], False
    for key in ("chosen", "rejected"):
        full = render(prompt + [_reply(record[key], where, key)], False)
        if not full.startswith(head):
            raise DataError(f"{where}: the chat template does not render the {key} reply after the prompt")
        ids = np.asarray(tokenizer.encode(full[len(head):].rstrip()), np.int32)
        if not len(ids):
            raise DataError(f"{where}: the {key} reply renders to no tokens")
        cut |= len(ids) > max_completion_len
        replies.append(ids[:max_completion_len])
    prompt_ids = np.asarray(tokenizer.encode(head), np.int32)
    cut |= len(prompt_ids) > max_prompt_len
    return Pair(str(record.get("id", where)), prompt_ids[-max_prompt_len:], replies[0], replies[1], bool(cut))


def encode_pairs(tokenizer, records: Sequence[tuple[str, Mapping]], settings: PairSettings) -> list[Pair]:
    """The pairs of (where, record) items; DataError for duplicate pair ids, and as `encode_pair`."""
    pairs = [encode_pair(tokenizer, r, where, settings.max_prompt_len, settings.max_completion_len)
             for where, r in records]
    ids = [p.pair_id for p in pairs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise DataError(f"duplicate preference pair ids {dup[:5]}: every record's 'id' must be unique")
    return pairs


def load_pairs(settings: PairSettings, tokenizer) -> tuple[list[Pair], list[Pair]]:
    """(train pairs, held-out pairs) of the settings' data; DataError when there is no training pair."""
    train = load_records(settings.train_path, settings.train_records, "train_examples")
    held = load_records(settings.eval_path, settings.eval_records, "eval_examples")
    if not held and settings.eval_fraction:
        train, held = split_records(train, settings.eval_fraction, settings.seed)
    source = settings.train_path or "train_examples"
    if not train:
        raise DataError(f"no preference pair to train on (from {source})")
    train_pairs = encode_pairs(tokenizer, train, settings)
    check_ties(train_pairs, source)
    return train_pairs, encode_pairs(tokenizer, held, settings)


def tied(pair: Pair) -> bool:
    """True when chosen and rejected are the same tokens after the cut: no preference, exactly zero gradient."""
    return len(pair.chosen) == len(pair.rejected) and bool(np.all(pair.chosen == pair.rejected))


def check_ties(pairs: Sequence[Pair], source: str) -> int:
    """The number of tied training pairs (`tied`), logged as a warning; DataError naming `source` if all are."""
    n = sum(map(tied, pairs))
    if pairs and n == len(pairs):
        raise DataError(f"every one of the {n} preference pairs from {source} has chosen == rejected (after the "
                        "length cut): no preference to learn")
    if n:
        log.warning("%d of %d preference pairs from %s have chosen == rejected (after the length cut): they carry "
                    "no preference and contribute zero gradient", n, len(pairs), source)
    return n


def data_hash(pairs: Sequence[Pair]) -> str:
    """sha256 hex of the pairs' ids and tokens (what the cached reference logprobs were computed on)."""
    h = hashlib.sha256()
    for p in pairs:
        h.update(json.dumps([p.pair_id, p.prompt.tolist(), p.chosen.tolist(), p.rejected.tolist()]).encode())
    return h.hexdigest()


def regions(pairs: Sequence[Pair]) -> tuple[int, int]:
    """(prompt region, reply region) in tokens: the longest prompt and reply of `pairs`, rounded up to ALIGN."""
    up = lambda n: -(-max(n, 1) // ALIGN) * ALIGN
    return up(max(len(p.prompt) for p in pairs)), up(max(max(len(p.chosen), len(p.rejected)) for p in pairs))


def make_batch(pairs: Sequence[Pair], prompt_region: int, reply_region: int, pad_id: int, num_pairs: int,
               ref_logp_N: np.ndarray | None = None) -> PairBatch:
    """The host `PairBatch` of `pairs`, padded with invalid rows to `num_pairs`; ValueError for what does not fit."""
    if len(pairs) > num_pairs:
        raise ValueError(f"{len(pairs)} pairs do not fit a batch of {num_pairs}")
    samples = []
    for i, p in enumerate(pairs):
        if len(p.prompt) > prompt_region or max(len(p.chosen), len(p.rejected)) > reply_region:
            raise ValueError(f"pair {p.pair_id!r} is longer than the batch regions ({prompt_region}, {reply_region})")
        for reply, reward in ((p.chosen, 1.0), (p.rejected, 0.0)):
            samples.append(Sample(domain="dpo", group=i, prompt_ids=p.prompt.tolist(), reward=reward, status="ok",
                                  done=True, truncated=p.truncated,
                                  segments=[(reply, np.zeros(len(reply), np.float32), True)]))
    no_advantage = lambda rewards, valid, G: _NoAdvantage(np.zeros_like(rewards), np.zeros(len(rewards) // G, bool))
    rows, _ = batching.assemble(samples, no_advantage, group_size=2, pad_id=pad_id, prompt_bucket=prompt_region,
                                completion_bucket=reply_region, row_bucket=2 * reply_region, row_multiple=num_pairs)
    fields = {f.name: getattr(rows, f.name) for f in dataclasses.fields(RolloutBatch)}
    if ref_logp_N is not None:
        ref_logp_N = np.concatenate([np.asarray(ref_logp_N, np.float32),
                                     np.zeros(2 * num_pairs - len(ref_logp_N), np.float32)])
    return PairBatch(**fields, ref_logp_N=ref_logp_N)


class _NoAdvantage(NamedTuple):
    advantages: np.ndarray
    zero_std_P: np.ndarray


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig:
    """The `dpo` section: preference pairs in TRL's format and the preference loss.

    Attributes:
      train_path: a JSONL file of {"prompt", "chosen", "rejected"} records ("": `train_examples`).
      train_examples: the same records inline (tiny runs and tests); at most one data source is set.
      eval_path: held-out pairs as a JSONL file ("": `eval_examples`, else `eval_fraction`).
      eval_examples: held-out pairs inline.
      eval_fraction: share in [0, 1) of the training records held out when no held-out data is given; with
        from_archive, of its prompts, and 0 holds out `from_archive.ARCHIVE_EVAL_FRACTION` (0.1) of them.
      loss: one of `LOSS_NAMES` (sigmoid: DPO; ipo: IPO; hinge: SLiC).
      beta: > 0, the implicit KL strength (TRL's default 0.1).
      label_smoothing: in [0, 0.5), conservative DPO's label-flip probability (sigmoid loss only).
      max_prompt_len: tokens; a longer prompt keeps its last tokens.
      max_completion_len: tokens; a longer reply keeps its first tokens.
      pairs_per_step: pairs in a step's batch (a multiple of num_microbatches x the mesh's batch shards).
      num_microbatches: gradient-accumulation microbatches.
      logprob_chunk: scored slots per unembedding chunk.
      reference_cache: keep the reference logprobs in `<workdir>/reference_logps.parquet` while model and data match.
      eval_at_start: held-out pair accuracy and margins before the first step.
      eval_at_end: the same after the last step.
      from_archive: GRPO run workdirs, comma-separated: pairs from their archived groups ("": not used).
    """

    train_path: str = ""
    train_examples: tuple[Mapping[str, Any], ...] = ()
    eval_path: str = ""
    eval_examples: tuple[Mapping[str, Any], ...] = ()
    eval_fraction: float = 0.0
    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    max_prompt_len: int = 256
    max_completion_len: int = 256
    pairs_per_step: int = 8
    num_microbatches: int = 1
    logprob_chunk: int = 256
    reference_cache: bool = True
    eval_at_start: bool = True
    eval_at_end: bool = True
    from_archive: str = ""

    def __post_init__(self):
        checks = {f"loss (one of {LOSS_NAMES})": self.loss in LOSS_NAMES, "beta (> 0)": self.beta > 0,
                  "label_smoothing (in [0, 0.5))": 0.0 <= self.label_smoothing < 0.5,
                  "label_smoothing (sigmoid loss only)": not (self.label_smoothing and self.loss != "sigmoid"),
                  "max_prompt_len (>= 1)": self.max_prompt_len >= 1,
                  "max_completion_len (>= 1)": self.max_completion_len >= 1,
                  "pairs_per_step (>= 1)": self.pairs_per_step >= 1,
                  **offline_checks(self)}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            shown = {k: v for k, v in dataclasses.asdict(self).items() if not k.endswith("_examples")}
            raise ValueError(f"invalid {', '.join(bad)} in dpo: {shown}")
