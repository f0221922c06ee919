"""FP8 block-quantised safetensors (DeepSeek-V3 / Kimi K2 format, docs/checkpoint_formats.md), dequantised on import.

Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

SCALE_SUFFIX = "_scale_inv"
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def weight_block(qc: Mapping | None) -> tuple[int, int] | None:
    """The (bO, bI) block of a config.json `quantization_config`; None when absent or empty.

    Raises ValueError naming the key and value for anything but quant_method "fp8", fmt "e4m3", activation_scheme
    "dynamic" (both may be absent) and weight_block_size a pair of positive ints."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"config.json quantization_config quant_method={method!r} is not supported: only 'fp8' "
                         "block-quantised checkpoints (DeepSeek-V3 / Kimi K2) are; load a dequantised bf16/f32 one")
    for key, ok in (("fmt", ("e4m3", None)), ("activation_scheme", ("dynamic", None))):
        if qc.get(key) not in ok:
            raise ValueError(f"config.json quantization_config {key}={qc.get(key)!r} is not supported; "
                             f"supported: {ok[0]!r}")
    block = qc.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"config.json quantization_config (quant_method='fp8') weight_block_size={block!r} is not "
                         "supported; expected two positive ints such as [128, 128] (per-tensor fp8 is not supported)")
    return int(block[0]), int(block[1])


def scale_shape(shape_OxI: tuple, block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(O / bO), ceil(I / bI)]: the `weight_scale_inv` shape of a weight of shape [O, I]."""
    return math.ceil(shape_OxI[0] / block[0]), math.ceil(shape_OxI[1] / block[1])


def dequantize(w_OxI: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = "weight") -> np.ndarray:
    """float32 [O, I]: each bO x bI block of float8_e4m3fn `w_OxI` times its scale (partial last blocks included).

    Raises ValueError naming `name` for a weight that is not 2-d float8_e4m3fn, or a scale of the wrong shape."""
    if w_OxI.dtype != ml_dtypes.float8_e4m3fn or w_OxI.ndim != 2:
        raise ValueError(f"tensor {name!r}: expected a 2-d float8_e4m3fn weight next to its {SCALE_SUFFIX} tensor, "
                         f"found {w_OxI.dtype} {tuple(w_OxI.shape)}")
    want = scale_shape(w_OxI.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"tensor {name + SCALE_SUFFIX!r}: expected shape {want} (weight {tuple(w_OxI.shape)} in "
                         f"{block[0]}x{block[1]} blocks), found {tuple(scale_inv.shape)}")
    out = np.asarray(w_OxI).astype(np.float32)
    scale = np.asarray(scale_inv, np.float32)
    for r in range(want[0]):
        out[r * block[0]:(r + 1) * block[0]] *= np.repeat(scale[r], block[1])[: out.shape[1]]
    return out


def read_header(file: pathlib.Path) -> tuple[dict, int]:
    """({name: {"dtype", "shape", "data_offsets"}}, byte offset of the data) of a safetensors file."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_raw(file: pathlib.Path, header: tuple[dict, int], name: str) -> np.ndarray:
    """Tensor `name` of a dtype in `RAW_DTYPES`, memory-mapped read-only; ValueError if its bytes do not fit."""
    entries, start = header
    e = entries[name]
    dtype = np.dtype(RAW_DTYPES[e["dtype"]])
    begin, end = e["data_offsets"]
    if end - begin != dtype.itemsize * math.prod(e["shape"]):
        raise ValueError(f"{file}: tensor {name!r} has {end - begin} bytes, not {e['shape']} x {dtype}")
    return np.memmap(file, np.uint8, "r", start + begin, (end - begin,)).view(dtype).reshape(e["shape"])


class Dequantized:
    """A tensor mapping (`load.SafetensorsDir`) whose float8 weights come out dequantised to float32.

    Raises ValueError naming the tensor for a float8 weight without its scale or with a misshapen one, or any
    float8 tensor when `block` is None (no quantization_config)."""

    def __init__(self, tensors, block: tuple[int, int] | None):
        self.tensors, self.block = tensors, block

    def __contains__(self, name):
        return name in self.tensors

    def keys(self):
        return self.tensors.keys()

    def _scale(self, name: str) -> str | None:
        scale = name + SCALE_SUFFIX
        is_f8 = self.tensors.dtype(name).startswith("F8")
        if self.block is None:
            if is_f8:
                raise ValueError(f"tensor {name!r} is {self.tensors.dtype(name)} but config.json has no "
                                 "quantization_config (expected fp8 weight_block_size)")
            return None
        if not is_f8:  # a scale next to an unquantised weight is read by nothing (check_unused names it)
            return None
        if scale not in self.tensors:
            raise ValueError(f"tensor {name!r} is {self.tensors.dtype(name)} but its scale {scale!r} is missing")
        return scale

    def shape(self, name: str) -> tuple:
        """The shape `name` is read with, from the headers; for a quantised weight, also checks its scale's."""
        shape = tuple(self.tensors.shape(name))
        scale = self._scale(name)
        if scale is not None:
            want, got = scale_shape(shape, self.block), tuple(self.tensors.shape(scale))
            if len(shape) != 2 or got != want:
                raise ValueError(f"tensor {scale!r}: expected shape {want} (weight {shape} in {self.block[0]}x"
                                 f"{self.block[1]} blocks), found {got}")
        return shape

    def __getitem__(self, name: str) -> np.ndarray:
        scale = self._scale(name)
        if scale is None:
            return self.tensors[name]
        return dequantize(self.tensors[name], self.tensors[scale], self.block, name)

    def scales_of(self, names: Iterable[str]) -> set[str]:
        """The `_scale_inv` tensors consumed by reading `names` (for `check_unused`)."""
        return {n + SCALE_SUFFIX for n in names if self.block is not None and n in self.tensors
                and self.tensors.dtype(n).startswith("F8") and n + SCALE_SUFFIX in self.tensors}
