"""The colab notebooks run top to bottom (headless, nbclient), in a temporary working directory, on the CPU path
(tpu.ipynb's TPU cells need a Colab TPU runtime and cannot run here)."""
import json
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

COLAB = pathlib.Path(__file__).resolve().parents[1] / "colab"
# notebook -> (its run's workdir, the last training step its parameter cell asks for, the per-step metric)
NOTEBOOKS = {"quickstart": ("runs/colab_quickstart", 8, "reward/mean"),
             "custom_env": ("runs/colab_custom_env", 3, "reward/mean"), "tpu": ("runs/colab_tpu", 2, "reward/mean"),
             "evaluate": ("runs/colab_evaluate", 3, "reward/mean"),
             "sft_dpo": ("runs/colab_sft_dpo/dpo", 2, "dpo/loss")}  # its tiny archive -> SFT -> DPO (2 steps each)


def test_every_notebook_is_listed():
    assert sorted(p.stem for p in COLAB.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_runs(name, tmp_path):
    path = COLAB / f"{name}.ipynb"
    assert path.exists(), f"{path} is missing"
    # the kernel inherits this process's environment: the suite's -O0 compiles (tests/conftest.py)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    workdir, steps, key = NOTEBOOKS[name]
    metrics = [json.loads(line) for line in (tmp_path / workdir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in metrics if key in r) == steps
