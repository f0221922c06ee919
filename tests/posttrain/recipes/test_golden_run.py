"""`configs/tiny.py` for 3 steps reproduces the run recorded before the phase-package move, exactly: every
non-timing metric of metrics.jsonl and the bytes of every array of the final checkpoint (tests/golden/)."""
import hashlib
import importlib.util
import json
import pathlib

import numpy as np

from posttrain.config import from_config_dict
from posttrain.recipes import grpo
from posttrain.recipes.run_plan import make_run_plan

ROOT = pathlib.Path(__file__).resolve().parents[3]
GOLDEN = json.loads((ROOT / "tests/golden/tiny_3_steps.json").read_text())
TIMING = ("perf/", "train_wall_s", "peak_rss")


def _config():
    spec = importlib.util.spec_from_file_location("tiny", ROOT / "configs/tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return from_config_dict(module.get_config())


def checkpoint_hashes(workdir: pathlib.Path) -> tuple[int, dict]:
    """(step, {leaf path: sha256 of its bytes}) of the newest checkpoint, read by orbax alone (no posttrain code)."""
    import jax
    import orbax.checkpoint as ocp

    ckpts = workdir / "checkpoints"
    step = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    tree = ocp.PyTreeCheckpointer().restore((ckpts / str(step) / "state").resolve())
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return step, {jax.tree_util.keystr(p): hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()
                  for p, x in leaves}


def test_tiny_three_steps_reproduce_the_recorded_run(tmp_path):
    grpo.train(make_run_plan(_config(), workdir=str(tmp_path)), progress=False)
    rows = [{k: v for k, v in json.loads(line).items() if not any(k.startswith(t) or t in k for t in TIMING)}
            for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == GOLDEN["metrics"]
    step, hashes = checkpoint_hashes(tmp_path)
    assert step == GOLDEN["final_step"] == 3
    assert sorted(hashes) == sorted(GOLDEN["checkpoint_sha256"])
    changed = [k for k in hashes if hashes[k] != GOLDEN["checkpoint_sha256"][k]]
    assert not changed, f"{len(changed)} of {len(hashes)} checkpoint arrays differ from the recording: {changed[:5]}"
