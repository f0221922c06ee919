"""Orbax train-state checkpoints: exact round trips, keep-K, shardings, crash/corruption recovery, donation."""
import glob
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain.checkpoints.orbax import Checkpointer, CheckpointCorruptError, CheckpointStructureError
from posttrain.model.moe import ExpertBias
from posttrain.model.presets import get_preset
from posttrain.model.transformer import Transformer
from posttrain.types import TrainState
from helpers import fake_devices_flags

REPO = pathlib.Path(__file__).resolve().parents[3]
META = {"cursor": {"epoch": 1, "index": 37, "order_seed": 5}, "config": {"model": "tiny", "lr": 1e-5},
        "rng_stream": {"draws": 12}}


def _subprocess(code: str, *, env_extra=None, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def train_state():
    """A real TrainState: tiny-deepseek params (Params with logical_axes, an ExpertBias), adamw state, ref params."""
    abstract = nnx.eval_shape(lambda: Transformer(get_preset("tiny-deepseek"), rngs=nnx.Rngs(0)))
    _, params, other = nnx.split(abstract, nnx.Param, ...)
    rng = np.random.default_rng(0)  # random values, no init compiles (eager init costs ~25 s on 2 cores)
    fill = lambda s: jnp.asarray(rng.standard_normal(s.shape).astype(np.float32),  # noqa: E731
                                 jnp.bfloat16 if len(s.shape) == 2 else s.dtype)  # some bf16 leaves too
    params, other = jax.tree.map(fill, params), jax.tree.map(fill, other)
    tx = optax.adamw(1e-3)
    return TrainState(step=jnp.array(7, jnp.int32), params=params, opt_state=tx.init(params),
                      frozen={"base": None, "other": other}, ref_params=jax.tree.map(jnp.copy, params),
                      rng=jax.random.key(1234))


def _assert_same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)  # incl. Variable types + metadata
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert str(jax.random.key_impl(x)) == str(jax.random.key_impl(y))
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _variables(state):
    return [(jax.tree_util.keystr(p), type(v), v.get_metadata().get("logical_axes")) for p, v in
            jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
            if isinstance(v, nnx.Variable)]


@pytest.mark.parametrize("template", ["abstract", "live"])
def test_round_trip_is_exact(tmp_path, train_state, template):
    with Checkpointer(tmp_path, every_steps=5, keep=2) as ck:
        assert ck.save(10, train_state, META)
        ck.wait()
        assert ck.latest_step() == 10
        target = jax.eval_shape(lambda: train_state) if template == "abstract" else train_state
        restored, meta = ck.restore(None, target)
    assert meta == META and ck.restored_step == 10
    _assert_same(restored, train_state)
    kinds = _variables(restored)
    assert kinds == _variables(train_state)
    assert any(t is ExpertBias for _, t, _ in kinds) and any(t is nnx.Param and ax for _, t, ax in kinds)
    # the same key stream continues: next draw equals the one from the original key
    assert jax.random.normal(restored.rng, (3,)).tolist() == jax.random.normal(train_state.rng, (3,)).tolist()


def test_should_save_every_n_force_at_end_and_keep_k(tmp_path):
    state = {"w": jnp.zeros((4,)), "step": jnp.zeros((), jnp.int32)}
    saved = []
    with Checkpointer(tmp_path, every_steps=3, keep=2, async_save=True) as ck:
        for step in range(1, 11):
            state = {"w": state["w"] + 1, "step": jnp.array(step, jnp.int32)}
            if ck.should_save(step):
                assert ck.save(step, state, {"step": step})
                saved.append(step)
            else:
                assert not ck.save(step, state, {"step": step})  # not due: nothing written
        assert ck.save(10, state, {"step": 10}, force=True)  # final step
        assert not ck.save(10, state, {"step": 10}, force=True)  # never overwrites
        ck.wait()
        assert saved == [3, 6, 9] and ck.all_steps() == [9, 10] and not ck.should_save(9)
        restored, meta = ck.restore(9, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "9"]
    assert meta == {"step": 9} and float(restored["w"][0]) == 9.0 and int(restored["step"]) == 9


def test_best_metric_keeps_the_best_checkpoint_beside_the_newest(tmp_path):
    """best_metric: the save with the highest metric stays beside the `keep` newest, also after a reopen (the
    evaluation gate's best checkpoint); saves without metrics are kept by recency only."""
    state = {"w": jnp.zeros((2,))}
    scores = {2: 0.5, 4: 0.9, 6: 0.2, 8: 0.9}  # ties: the later step
    with Checkpointer(tmp_path, every_steps=1, keep=1, best_metric="score") as ck:
        for step in range(1, 8):
            ck.save(step, state, {}, metrics={"score": scores[step]} if step in scores else None)
        ck.wait()
        assert ck.all_steps() == [4, 7]
    with Checkpointer(tmp_path, every_steps=1, keep=1, best_metric="score") as ck:
        ck.save(8, state, {}, metrics={"score": scores[8]})
        ck.save(9, state, {})
        ck.wait()
        assert ck.all_steps() == [8, 9]


def test_guard_checkpoints_are_kept_only_while_newest(tmp_path):
    """save(guard=True) (the learner's boundary after a long step): a guard is kept only until a newer checkpoint
    commits and never displaces the `keep` interval ones; a forced save of a guard step (the final one) keeps it."""
    state = {"w": jnp.zeros((2,))}
    with Checkpointer(tmp_path, every_steps=4, keep=1) as ck:
        assert ck.save(4, state, {})  # the interval's
        for step in (5, 6):
            assert ck.save(step, state, {}, force=True, guard=True)
            ck.wait()
        assert ck.all_steps() == [4, 6] and ck.guards == {5, 6}
        assert not ck.save(6, state, {}, force=True)  # the final save of step 6: already on disk, now kept
        assert ck.save(7, state, {}, force=True, guard=True)
        ck.wait()
        assert ck.all_steps() == [6, 7] and ck.guards == {5, 7}
        assert ck.save(8, state, {})
        ck.wait()
        assert ck.all_steps() == [8]


def test_async_save_then_donation_keeps_saved_values(tmp_path):
    """The train step donates its state: buffers reused right after `save` returns must not reach the files."""
    state = {"w": jnp.arange(4_000_000, dtype=jnp.float32), "rng": jax.random.key(3)}
    expected = np.asarray(state["w"]).copy()
    step = jax.jit(lambda s: {"w": s["w"] * 0.0 - 1.0, "rng": jax.random.split(s["rng"])[0]}, donate_argnums=0)
    with Checkpointer(tmp_path, every_steps=1, keep=1, async_save=True) as ck:
        assert ck.save(1, state, {})
        new = step(state)  # immediately: donate + overwrite
        new = step(new)
        del state
        assert float(new["w"][0]) == -1.0
        ck.wait()
        restored, _ = ck.restore(1, new)
    np.testing.assert_array_equal(np.asarray(restored["w"]), expected)
    np.testing.assert_array_equal(jax.random.key_data(restored["rng"]), jax.random.key_data(jax.random.key(3)))


def test_structure_mismatch_names_the_difference(tmp_path, train_state):
    with Checkpointer(tmp_path, every_steps=1, keep=1, async_save=False) as ck:
        ck.save(1, train_state, {})
        with pytest.raises(CheckpointStructureError, match=r"in the checkpoint but not in the target: \['ref_params/"):
            ck.restore(None, train_state.replace(ref_params=None))
        bad = train_state.replace(step=jnp.zeros((2,), jnp.int32))
        with pytest.raises(CheckpointStructureError, match=r"step: shape \[\] in the checkpoint, \[2\]"):
            ck.restore(1, bad)
        retyped = jax.tree.map(  # ExpertBias in the checkpoint, a Param at the same path in the target
            lambda v: nnx.Param(v.get_value(), **v.get_metadata()) if isinstance(v, ExpertBias) else v,
            train_state.frozen["other"], is_leaf=lambda x: isinstance(x, nnx.Variable))
        with pytest.raises(CheckpointStructureError, match="variable ExpertBias in the checkpoint, Param"):
            ck.restore(1, train_state.replace(frozen={"base": None, "other": retyped}))
        with pytest.raises(CheckpointStructureError, match=r"dtype key<fry> in the checkpoint, uint32"):
            ck.restore(1, train_state.replace(rng=jax.random.key_data(train_state.rng)))


def _two_steps(directory):
    with Checkpointer(directory, every_steps=1, keep=5, async_save=False) as ck:
        ck.save(1, {"w": jnp.full((64,), 1.0)}, {"index": 1})
        ck.save(2, {"w": jnp.full((64,), 2.0)}, {"index": 2})
    return {"w": jnp.zeros((64,))}


def test_truncated_file_falls_back_to_previous_step(tmp_path):
    target = _two_steps(tmp_path)
    for f in glob.glob(str(tmp_path / "2" / "state" / "**" / "d" / "*"), recursive=True):
        os.truncate(f, os.path.getsize(f) // 2)
    with Checkpointer(tmp_path, every_steps=1, keep=5) as ck:
        with pytest.raises(CheckpointCorruptError, match=str(tmp_path / "2")):
            ck.restore(2, target)
        restored, meta = ck.restore(None, target)
        assert meta == {"index": 1} and ck.restored_step == 1 and float(restored["w"][0]) == 1.0
        assert ck.latest_step() == 1  # the unreadable step was moved aside (not deleted) ...
        assert len(glob.glob(str(tmp_path / "2.corrupt-*"))) == 1
        assert ck.save(2, {"w": jnp.full((64,), 2.5)}, {"index": 2})  # ... so the resumed run can write it again
        ck.wait()
        assert ck.all_steps() == [1, 2]


def test_bytes_that_decode_but_differ_fall_back_by_checksum(tmp_path):
    """Step 2's array files replaced by step 1's (valid files of another content, as bit rot that still decodes
    leaves them): the content checksum in step 2's manifest catches it, as a truncated file is caught."""
    import shutil

    target = _two_steps(tmp_path)
    shutil.rmtree(tmp_path / "2" / "state")
    shutil.copytree(tmp_path / "1" / "state", tmp_path / "2" / "state")
    with Checkpointer(tmp_path, every_steps=1, keep=5) as ck:
        with pytest.raises(CheckpointCorruptError, match=r"content checksum mismatch in 1 array\(s\) of .*2, the "
                                                         r"first: w: saved \[\d+, \d+\], read"):
            ck.restore(2, target)
        restored, meta = ck.restore(None, target)
        assert meta == {"index": 1} and float(restored["w"][0]) == 1.0
        assert "content checksum mismatch" in ck.unreadable[0]["error"] and ck.unreadable[0]["moved_to"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "bool", "uint16"])  # no 8-byte types
# without jax_enable_x64 (a checkpoint holds none then)
def test_checksums_equal_the_numpy_reference(dtype):
    """s1 = sum w_i, s2 = sum (i + 1) w_i mod 2^32 over the little-endian words (checksum module doc), for jax and
    NumPy arrays, and changed by one flipped bit (sharded arrays: test_sharded_round_trip_restores_target_shardings,
    whose restore into another layout also verifies them)."""
    from posttrain.checkpoints import checksum

    rng = np.random.default_rng(0)
    x = rng.integers(-1000, 1000, (16, 24)).astype(jnp.dtype(dtype)) if dtype != "bool" else rng.random((16, 24)) > .5
    raw = np.frombuffer(np.ascontiguousarray(np.asarray(x)).tobytes(),
                        {8: "<u4", 4: "<u4", 2: "<u2", 1: "<u1"}[np.dtype(x.dtype).itemsize]).astype(np.uint64)
    i = np.arange(1, raw.size + 1, dtype=np.uint64)
    want = [int(raw.sum() % 2 ** 32), int((raw * i).sum() % 2 ** 32)]
    assert checksum.checksums([jnp.asarray(x), np.asarray(x)]) == [want] * 2
    flipped = np.asarray(x).copy()
    flipped.view(np.uint8).reshape(-1)[37] ^= 0x01  # one bit of one byte
    assert checksum.checksums([flipped])[0] != want


def test_step_without_commit_marker_is_skipped(tmp_path):
    target = _two_steps(tmp_path)
    (tmp_path / "2" / "commit_success.txt").unlink()
    with Checkpointer(tmp_path, every_steps=1, keep=5) as ck:
        assert ck.latest_step() == 1 and ck.all_steps() == [1]
        with pytest.raises(FileNotFoundError, match=r"step 2 .*complete steps: \[1\]"):
            ck.restore(2, target)
        _, meta = ck.restore(None, target)
        assert meta == {"index": 1} and len(glob.glob(str(tmp_path / "2.corrupt-*"))) == 1
        assert ck.save(2, {"w": jnp.full((64,), 2.5)}, {"index": 2})  # the resumed run rewrites step 2
        ck.wait()
        assert ck.latest_step() == 2


def test_read_only_reader_never_modifies_the_directory(tmp_path):
    target = _two_steps(tmp_path)
    (tmp_path / "3.orbax-checkpoint-tmp-1234").mkdir()  # a trainer's in-flight save
    os.truncate(tmp_path / "2" / "manifest" / "metadata", 3)
    before = sorted(p.name for p in tmp_path.iterdir())
    with Checkpointer(tmp_path, every_steps=1, keep=1, read_only=True) as ck:
        _, meta = ck.restore(None, target)
        assert meta == {"index": 1}
        with pytest.raises(ValueError, match="read-only; cannot save step 4"):
            ck.save(4, target, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_no_usable_checkpoint_is_one_clear_error(tmp_path):
    target = {"w": jnp.zeros((64,))}
    with Checkpointer(tmp_path / "empty", every_steps=1, keep=1) as ck:
        assert ck.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no complete checkpoint in .*empty"):
            ck.restore(None, target)
    _two_steps(tmp_path / "run")
    for s in ("1", "2"):
        (tmp_path / "run" / s / "manifest" / "metadata").write_text('{"format": 1, "lea')  # truncated JSON
    with Checkpointer(tmp_path / "run", every_steps=1, keep=1) as ck:
        with pytest.raises(CheckpointCorruptError, match=r"no usable checkpoint in .*run:\n  step 2: .*\n  step 1: "):
            ck.restore(None, target)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="every_steps must be >= 1, got 0"):
        Checkpointer(tmp_path, every_steps=0, keep=1)
    with pytest.raises(ValueError, match="keep must be >= 1, got 0"):
        Checkpointer(tmp_path, every_steps=1, keep=0)
    with Checkpointer(tmp_path, every_steps=1, keep=1) as ck:
        with pytest.raises(TypeError, match="meta is not JSON-serialisable"):
            ck.save(1, {"w": jnp.zeros(2)}, {"bad": object()})
        with pytest.raises(TypeError, match="state leaf w is a str"):
            ck.save(1, {"w": "text"}, {})
        assert ck.latest_step() is None
    with pytest.raises(ValueError, match="is closed"):
        ck.latest_step()


KILL_CHILD = """
import os, signal, sys, time
import jax.numpy as jnp
from posttrain.checkpoints.orbax import Checkpointer
ck = Checkpointer({d!r}, every_steps=1, keep=3, async_save=True)
ck.save(1, {{"w": jnp.full((16_000_000,), 1.0)}}, {{"index": 1}})
ck.wait()
ck.save(2, {{"w": jnp.full((16_000_000,), 2.0)}}, {{"index": 2}})  # 64 MB: the background write is in flight
for _ in range(20_000):  # under load the temp folder can appear after save() returns: kill once it is there
    if any(n.startswith("2.orbax-checkpoint-tmp") for n in os.listdir({d!r})):
        break
    time.sleep(0.0005)
print("killing", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_9_during_async_save_keeps_previous_checkpoint(tmp_path):
    proc = _subprocess(KILL_CHILD.format(d=str(tmp_path)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "killing" in proc.stdout
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "1" in names and "2" not in names, names
    assert any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names  # killed mid-save
    target = {"w": jnp.zeros((16_000_000,))}
    with Checkpointer(tmp_path, every_steps=1, keep=3) as ck:
        assert ck.latest_step() == 1
        restored, meta = ck.restore(None, target)
        assert meta == {"index": 1} and float(restored["w"][-1]) == 1.0
        assert ck.save(2, {"w": jnp.full((16_000_000,), 2.0)}, {"index": 2})
        ck.wait()
        assert ck.all_steps() == [1, 2]
    assert not any("tmp" in p.name for p in tmp_path.iterdir())  # partial dir cleaned up on reopen


SHARDED_CHILD = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from posttrain.infra import mesh as mesh_lib
from posttrain.checkpoints.orbax import Checkpointer
from posttrain.model.presets import get_preset
from posttrain.model.transformer import Transformer

assert jax.device_count() == 8
mesh = mesh_lib.make_mesh({{"data": 2, "fsdp": 4}})
abstract = nnx.state(nnx.eval_shape(lambda: Transformer(get_preset("tiny-dense"), rngs=nnx.Rngs(0))))
rng = np.random.default_rng(0)  # random values placed with the model's rule-derived shardings (no init compile)
params = jax.tree.map(lambda s, sh: jax.device_put(rng.standard_normal(s.shape).astype(s.dtype), sh),
                      abstract, mesh_lib.state_shardings(abstract, mesh))
keys = jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(mesh, P("data")))
state = {{"params": params, "keys": keys, "rng": jax.device_put(jax.random.key(9), NamedSharding(mesh, P()))}}
sharded = [x for x in jax.tree.leaves(params) if not x.sharding.is_fully_replicated]
assert len(sharded) >= 3, "test premise: some params are sharded"
from posttrain.checkpoints import checksum  # the sums of sharded arrays are those of their host copies
assert checksum.checksums(sharded) == checksum.checksums([np.asarray(x) for x in sharded])
with Checkpointer({d!r}, every_steps=1, keep=1) as ck:
    ck.save(1, state, {{"index": 3}})
    ck.wait()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    out, meta = ck.restore(None, abstract)
    # a different target layout: everything on 'fsdp' where divisible, else replicated
    other = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
        mesh, P("fsdp") if x.ndim and x.shape[0] % 4 == 0 else P())), state)
    out2, _ = ck.restore(1, other)
for a, b, t, c, t2 in zip(jax.tree.leaves(out), jax.tree.leaves(state), jax.tree.leaves(abstract),
                          jax.tree.leaves(out2), jax.tree.leaves(other)):
    assert a.sharding == t.sharding and a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
    assert c.sharding.is_equivalent_to(t2.sharding, c.ndim), (c.sharding, t2.sharding)
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b, c = (jax.random.key_data(v) for v in (a, b, c))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(c), np.asarray(b))
assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(state) and meta == {{"index": 3}}
print("SHARDED_OK", len(sharded))
"""


def test_sharded_round_trip_restores_target_shardings(tmp_path):
    proc = _subprocess(SHARDED_CHILD.format(d=str(tmp_path)),
                       env_extra={"XLA_FLAGS": fake_devices_flags(8), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "SHARDED_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]

