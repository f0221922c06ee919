"""Load pretrained weights (HF safetensors directory or GGUF file) into a sharded nnx state: `load_pretrained`.

Readers (`SafetensorsDir`, `gguf`) and placement (`place`, per shard); the tensor mapping is `hf`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import Callable, Mapping, NamedTuple

import jax
import numpy as np
from flax import nnx

from posttrain.checkpoints import fp8 as fp8_lib
from posttrain.checkpoints import gguf as gguf_lib
from posttrain.checkpoints import hf as hf_lib
from posttrain.checkpoints import hf_config as hf_config_lib
from posttrain.checkpoints import hub
from posttrain.infra import mesh as mesh_lib
from posttrain.model.config import ModelConfig
from posttrain.model.layers import LoRAParam
from posttrain.model.tokenizer import Tokenizer
from posttrain.model.transformer import Transformer

log = logging.getLogger(__name__)


class Pretrained(NamedTuple):
    """A loaded model: its config, nnx graphdef and state (params + other variables), and tokenizer (or None)."""

    config: ModelConfig
    graphdef: object
    state: object
    tokenizer: object


# --------------------------------------------------------------------------------------------- reading
class SafetensorsDir:
    """Lazy tensor access over a directory's safetensors; FileNotFoundError without any, ValueError if unreadable."""

    def __init__(self, path: pathlib.Path):
        from safetensors import safe_open

        self.path = path
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        self.handles, self.where, self.headers = {}, {}, {}
        for f in files:
            try:
                h = safe_open(str(path / f), framework="flax")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"{path / f}: not a readable safetensors file ({e})") from e
            self.handles[f] = h
            for k in h.keys():
                self.where[k] = f
        if weight_map:
            missing = sorted(set(weight_map) - set(self.where))
            if missing:
                raise ValueError(f"{index}: tensors listed but absent from the shards, e.g. {missing[:3]}")

    def __contains__(self, name):
        return name in self.where

    def keys(self):
        return self.where.keys()

    def shape(self, name) -> tuple:
        """The stored shape of `name`, from the header (nothing is read)."""
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def dtype(self, name) -> str:
        """The safetensors dtype code of `name` (F32, BF16, F8_E4M3, ...), from the header."""
        return self.handles[self.where[name]].get_slice(name).get_dtype()

    def __getitem__(self, name) -> np.ndarray:
        try:
            f = self.where[name]
            if self.dtype(name) in fp8_lib.RAW_DTYPES:  # safetensors has no NumPy path for float8
                if f not in self.headers:
                    self.headers[f] = fp8_lib.read_header(self.path / f)
                return fp8_lib.read_raw(self.path / f, self.headers[f], name)
            return np.asarray(self.handles[f].get_tensor(name))
        except KeyError:
            raise
        except Exception as e:
            raise ValueError(f"{self.path}: tensor {name!r} could not be read ({e})") from e


# --------------------------------------------------------------------------------------------- placing
def place(cfg: ModelConfig, arrays_fn: Callable[[dict], dict], mesh=None, rules=mesh_lib.RULES, seed: int = 0):
    """Places the parameters `arrays_fn(expected_shapes)` gives ({path: array or `hf.Lazy`}) sharded on `mesh`."""
    import jax.numpy as jnp

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
    graphdef, abstract_state = nnx.split(abstract)
    mesh = mesh if mesh is not None else mesh_lib.make_mesh({"fsdp": 1}, jax.devices()[:1])
    shardings = mesh_lib.state_shardings(abstract_state, mesh, rules)
    flat_abs = dict(nnx.to_flat_state(abstract_state))
    flat_sh = dict(nnx.to_flat_state(shardings))
    # per-layer shapes for stacked blocks (the table converts one layer at a time)
    expected = {path: tuple(v.shape[1:] if path[0].endswith("_layers") else v.shape) for path, v in flat_abs.items()}
    arrays = dict(arrays_fn(expected))
    leaves = []
    rng = np.random.default_rng(seed)
    for path, v in flat_abs.items():
        if path not in arrays and isinstance(v, LoRAParam):  # fresh adapters: A Gaussian (fan-in), B zero
            fan_in = v.shape[-2]
            arrays[path] = (rng.standard_normal(v.shape) * fan_in ** -0.5 if path[-1].endswith("_lora_a")
                            else np.zeros(v.shape))
        if path not in arrays:
            raise ValueError(f"no weights for parameter {'/'.join(map(str, path))}")
        got, dtype = arrays.pop(path), jnp.dtype(v.dtype)
        if isinstance(got, hf_lib.Lazy):  # read per shard, straight into its final sharding
            shape, read = got.shape, lambda i, r=got.read, d=dtype: np.asarray(r(i)).astype(d)
        else:
            host = np.asarray(got).astype(dtype)
            shape, read = host.shape, lambda i, h=host: h[i]
        if tuple(shape) != tuple(v.shape):
            raise ValueError(f"parameter {'/'.join(map(str, path))}: expected shape {tuple(v.shape)}, got {shape}")
        sharding = flat_sh[path].get_value() if isinstance(flat_sh[path], nnx.Variable) else flat_sh[path]
        leaves.append((path, v.replace(jax.make_array_from_callback(tuple(shape), sharding, read))))
    return graphdef, nnx.from_flat_state(leaves)


def _tied_head(cfg: ModelConfig, tensors) -> ModelConfig:
    """`cfg` untied when the file's `lm_head.weight` differs from the embedding, as transformers' `tie_weights`."""
    if not cfg.tie_embeddings or "lm_head.weight" not in tensors:
        return cfg
    if np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
        return cfg
    log.warning("tie_word_embeddings is true but the file's lm_head.weight differs from the embedding: loading it "
                "untied, as transformers does")
    return dataclasses.replace(cfg, tie_embeddings=False)


def load_hf_dir(path, *, mesh=None, rules=mesh_lib.RULES, dtype: str | None = None, param_dtype: str | None = None,
                **overrides) -> Pretrained:
    """Loads config.json, safetensors (fp8 ones dequantised) and the tokenizer if present from an HF directory.

    Args:
      dtype, param_dtype: compute and storage dtypes (None: the checkpoint's, `hf_config.file_dtype`).
      overrides: other ModelConfig fields.
    Raises:
      FileNotFoundError: no config.json or safetensors.
      ValueError: an unsupported config value, a missing, misshapen or unused tensor, a bad fp8 scale (named)."""
    path = pathlib.Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (expected an HF model directory or a .gguf file)")
    hf_config = json.loads((path / "config.json").read_text())
    cfg = hf_lib.config_from_hf(hf_config, dtype=dtype, param_dtype=param_dtype)
    norm = hf_config_lib.normalized(hf_config)
    tensors = fp8_lib.Dequantized(SafetensorsDir(path), norm["weight_block_size"])
    cfg = dataclasses.replace(_tied_head(cfg, tensors), **overrides)
    used = {"lm_head.weight"} if cfg.tie_embeddings else set()  # equal to the embedding (checked above)
    graphdef, state = place(cfg, lambda expected: hf_lib.hf_to_arrays(
        cfg, tensors, expected, rope_interleave=bool(norm.get("rope_interleave", True)), used=used), mesh, rules)
    hf_lib.check_unused(tensors.keys(), used | tensors.scales_of(used), cfg.num_layers,
                        norm.get("num_mtp_layers") or 0)
    tokenizer = None
    if (path / "tokenizer.json").exists():

        tokenizer = Tokenizer.from_hf_dir(path)
    return Pretrained(cfg, graphdef, state, tokenizer)


def gguf_file_dtype(tensor_types: Mapping[str, int]) -> str:
    """float16 / bfloat16 when every non-F32 tensor is F16 / BF16, else float32 (quantized blocks are exact in it)."""
    kinds = set(tensor_types) - {"F32"}
    return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(frozenset(kinds), "float32")


def load_gguf_file(path, *, mesh=None, rules=mesh_lib.RULES, dtype: str | None = None,
                   param_dtype: str | None = None, **overrides) -> Pretrained:
    """Loads a GGUF file and its tokenizer; dtype / param_dtype None: the file's (`gguf_file_dtype`)."""
    ckpt = gguf_lib.load_gguf(path)
    own = gguf_file_dtype(ckpt.metadata["tensor_types"])
    cfg = dataclasses.replace(hf_lib.config_from_hf(ckpt.hf_config, dtype=dtype or own,
                                                    param_dtype=param_dtype or own), **overrides)
    graphdef, state = place(cfg, lambda expected: hf_lib.hf_to_arrays(cfg, ckpt.state_dict, expected), mesh, rules)
    return Pretrained(cfg, graphdef, state, ckpt.tokenizer)


RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json")  # what marks a posttrain run directory


def check_model_path(path) -> None:
    """Checks, without reading weights, that `path` is a GGUF file or an HF directory of a supported model_type.

    Raises FileNotFoundError when it does not exist, ValueError naming the path otherwise (a posttrain run directory
    with the command that exports its policy). A Hugging Face Hub id reads its snapshot in the local cache."""
    path = pathlib.Path(hub.resolve(path))
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory (a .gguf file or an HF model directory)")
    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes) nor an HF model directory")
        return
    if any((path / name).exists() for name in RUN_FILES):
        raise ValueError(f"{path} is a posttrain run directory, not a model: resume it with --workdir={path}, or "
                         f"export its policy with `posttrain convert --checkpoint={path} --out=DIR` and load DIR")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json (expected an HF model directory or a .gguf file)")
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}/config.json is not a JSON object: {e}") from None
    if model_type not in hf_config_lib.SUPPORTED:
        raise ValueError(f"{path}/config.json: model_type={model_type!r} is not supported; supported: "
                         f"{hf_config_lib.SUPPORTED}")


def load_pretrained(path=None, **kwargs) -> Pretrained:
    """Loads a `.gguf` file or an HF directory (None: the default SmolLM2-135M-Instruct GGUF).

    An "org/name" Hub id that is no local path loads its snapshot from the local Hugging Face cache (`hub.resolve`).

    kwargs: mesh, rules (logical-axis rules), dtype, param_dtype and other ModelConfig fields (e.g.
    lora=LoRAConfig(rank=16): adapters absent from the checkpoint start fresh). Raises as `load_hf_dir`."""
    if path is None:

        path = gguf_lib.default_model_path()
    path = pathlib.Path(hub.resolve(path))
    if path.is_dir():
        return load_hf_dir(path, **kwargs)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model file or directory")
    return load_gguf_file(path, **kwargs)

