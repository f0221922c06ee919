"""Cached reference logprobs of DPO: a Parquet row of (ref_chosen, ref_rejected) nats per pair, hashes in metadata."""
from __future__ import annotations

import pathlib
from typing import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.infra.files import atomic_write

SCHEMA_VERSION = "1"


def write(path: pathlib.Path, ref_logps: Mapping[str, tuple[float, float]], reference_hash: str,
          data_hash: str) -> None:
    """Writes {pair_id: (ref_chosen, ref_rejected)} to `path` with the hashes (atomically)."""
    ids = list(ref_logps)
    table = pa.table({"pair_id": pa.array(ids, pa.string()),
                      "ref_chosen": pa.array([ref_logps[i][0] for i in ids], pa.float32()),
                      "ref_rejected": pa.array([ref_logps[i][1] for i in ids], pa.float32())})
    table = table.replace_schema_metadata({"schema_version": SCHEMA_VERSION, "reference_hash": reference_hash,
                                           "data_hash": data_hash})
    atomic_write(path, lambda f: pq.write_table(table, f), binary=True)


def read(path: pathlib.Path, reference_hash: str, data_hash: str) -> dict[str, tuple[float, float]] | None:
    """{pair_id: (ref_chosen, ref_rejected)} from `path` when its schema version and both hashes match, else None."""
    if not path.is_file():
        return None
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid):
        return None
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    if (meta.get("schema_version"), meta.get("reference_hash"), meta.get("data_hash")) != (
            SCHEMA_VERSION, reference_hash, data_hash):
        return None
    cols = table.to_pydict()
    return {i: (float(c), float(r)) for i, c, r in zip(cols["pair_id"], cols["ref_chosen"], cols["ref_rejected"])}


def as_samples(pair_ids, ref_logps: Mapping[str, tuple[float, float]]) -> np.ndarray:
    """float32 [2 * len(pair_ids)]: the pairs' (chosen, rejected) reference logprobs in batch sample order."""
    return np.asarray([v for i in pair_ids for v in ref_logps[i]], np.float32)
