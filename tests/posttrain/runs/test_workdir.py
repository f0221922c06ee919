"""`runs.workdir`: what a training command may write (`claim`) and where `convert` may export
(`check_export_dir`), checked before anything is written: each refusal is a ConfigError naming the path."""
import json
import os

import pytest

from posttrain.config import ConfigError
from posttrain.runs import workdir

RUN = {"model": {"preset": "tiny-dense"}, "train": {"steps": 2}}


def write(path, config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("saved, kind, message", [
    ({**RUN, "rl": {}}, "sft", "holds a GRPO run .*; an SFT run .* would overwrite it"),
    ({**RUN, "sft": {}}, "grpo", "holds an SFT run .*; a GRPO run .* would overwrite it"),
    ({**RUN, "dpo": {}}, "rm", "holds a DPO run .*; a reward-model run .* would overwrite it"),
    ({"architectures": ["LlamaForCausalLM"], "vocab_size": 3}, "sft", "config.json is not a posttrain run's"),
])
def test_a_workdir_of_another_kind_is_refused(tmp_path, saved, kind, message):
    write(tmp_path / "run", saved)
    with pytest.raises(ConfigError, match=message):
        workdir.claim(tmp_path / "run", kind, {**RUN, kind: {}})
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == saved


def test_new_and_same_kind_workdirs_are_claimed_without_writing(tmp_path):
    assert workdir.claim(tmp_path / "new" / "deeper", "sft", RUN) == {}
    assert not (tmp_path / "new").exists()  # claim writes nothing; write_config does
    write(tmp_path / "same", {**RUN, "sft": {}})
    assert workdir.claim(tmp_path / "same", "sft", {**RUN, "sft": {"lr": 9}}) == {}  # no checkpoint: nothing resumes
    workdir.write_config(tmp_path / "new", RUN)
    assert json.loads((tmp_path / "new" / "config.json").read_text()) == RUN


def test_files_and_unwritable_directories_are_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="--workdir=.*afile: is a file, not a directory"):
        workdir.claim(tmp_path / "afile", "grpo", RUN)
    with pytest.raises(ConfigError, match="afile is a file, not a directory"):
        workdir.claim(tmp_path / "afile" / "run", "grpo", RUN)
    if os.geteuid() != 0:  # root may write anywhere: the permission case is the read-only file system's then
        (tmp_path / "ro").mkdir(mode=0o555)
        with pytest.raises(ConfigError, match="is not writable"):
            workdir.claim(tmp_path / "ro" / "run", "grpo", RUN)


def test_export_dir_is_never_a_run(tmp_path):
    run = write(tmp_path / "run", {**RUN, "rl": {}})
    with pytest.raises(ConfigError, match="--out=.* is the run being exported"):
        workdir.check_export_dir(run, source=run)
    with pytest.raises(ConfigError, match="--out=.* holds a posttrain run"):
        workdir.check_export_dir(run)
    (tmp_path / "other" / "checkpoints").mkdir(parents=True)  # a run's outputs, its config.json lost
    with pytest.raises(ConfigError, match="holds a posttrain run"):
        workdir.check_export_dir(tmp_path / "other")
    hf = write(tmp_path / "hf", {"architectures": ["LlamaForCausalLM"]})  # an earlier export: overwritten
    assert workdir.check_export_dir(hf, source=run) == hf
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="--out=.*f: is a file"):
        workdir.check_export_dir(tmp_path / "f")
