"""configs/repo_fix_tiny.py trains on RepoFix-v0 end to end (issue 27 item 6): a scripted policy reads the package,
then applies the inverse patch (even rows) or not (odd rows) and submits, through 3 tool turns; the rewards come
from the hidden tests (exactly 1 / 0 by row), and the loss sees only the policy's tokens (the tool results between
turns are masked: response_length counts the scripted replies' tokens, no more)."""
import importlib.util
import json
import pathlib

import numpy as np

from envs.tasks.repo_fix import tools
from helpers import scripted_output
from posttrain.config import from_config_dict
from posttrain.recipes import grpo
from posttrain.rollout.rollouter import Rollouter
from posttrain.scheduling import archive
from posttrain.scheduling.weighted_draw import WeightedDraw

ROOT = pathlib.Path(__file__).resolve().parents[3]
TASKS = (0, 4)  # two problems (a problem has 4 task slots)
READ = tools.format_call("read_file", path="toolbox/core.py")
LIST = tools.format_call("list_files", path="tests")
SUBMIT = tools.format_call("submit")


def tiny_config(workdir):
    spec = importlib.util.spec_from_file_location("repo_fix_tiny", ROOT / "configs/repo_fix_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.train.workdir, c.train.steps = str(workdir), 1
    c.checkpoint.async_save = False
    return from_config_dict(c)


def scripted(monkeypatch, golden: dict[str, str]):
    """The rollouter's sampler replaced by a script (row parity decides the fix); returns the replies it gave."""
    given = []

    def reply_for(text: str, row: int) -> str:
        turn = text.count("<tool_response")
        if turn == 0:
            return READ
        if turn == 1:
            patch = next(p for entry, p in golden.items() if f'"""{entry}:' in text)
            return tools.format_call("apply_patch", patch=patch) if row % 2 == 0 else LIST
        return SUBMIT

    def sample_fn(rollouter, policy, params):
        tok, Lg = rollouter.tokenizer, params.max_new_tokens

        def fn(prompts, lengths, key, group_size):
            texts = [tok.decode([int(t) for t in p[:n]], skip_special_tokens=False)
                     for p, n in zip(np.asarray(prompts), np.asarray(lengths))]
            replies = [reply_for(t, i * group_size + g) for i, t in enumerate(texts) for g in range(group_size)]
            given.extend(replies)
            return scripted_output([tok.encode(r) + [tok.eos_id] for r in replies], tok.pad_id, Lg, -1.0)

        return fn

    monkeypatch.setattr(Rollouter, "sample_fn", sample_fn)
    return given


def test_tiny_repo_fix_config_trains_on_hidden_test_rewards_with_tool_turns_masked(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path / "run")
    from envs.tasks.repo_fix.tasks import RepoFixTasks

    source = RepoFixTasks("train")
    tasks = [source.get_task(i) for i in TASKS]
    golden = {t["suites"]["hidden"][0]["entry"]: t["golden_patch"] for t in tasks}
    assert len(golden) == 2
    monkeypatch.setattr(WeightedDraw, "next_draws", lambda self, step, n: [
        (self.names[0], i, 0, self.sources[self.names[0]].get_task(i)) for i in TASKS[:n]])
    given = scripted(monkeypatch, golden)
    summary = grpo.train(cfg, progress=False)
    assert summary["end_step"] == 1
    (m,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = archive.read(tmp_path / "run", steps=[0]).to_pylist()
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0, 0.0] and m["reward/mean"] == 0.5
    details = [json.loads(r["details"]) for r in rows]
    assert all(d["turns"] == 3 for d in details), details
    assert len(given) == 12 and given.count(SUBMIT) == 4
    # the loss sees the policy's tokens only: 3 replies (+ EOS each) per sample, none of the tool results
    from posttrain.model.tokenizer import Tokenizer

    tok = Tokenizer.byte_level()
    per_sample = np.array([len(tok.encode(r)) + 1 for r in given]).reshape(3, 4).sum(0)
    assert m["response_length/mean"] == per_sample.mean()
    assert np.isfinite(m["policy/loss"]) and m["optim/grad_norm"] > 0
