"""Offline data from the episode archive (`posttrain.algos.from_archive`) on a synthetic archive written with
`scheduling.archive.write_step`: the SFT examples (successful, distinct, at most K per prompt, reply-only mask,
held-out prompts never trained), the DPO pairs (one group, same policy version, 1 over 0), the rows left out
(no reward, multi-turn, another split) and the errors; then `posttrain sft` / `dpo` recipes read a run's archive
(2 steps of the tiny configs) and a run directory without an archive is one clear error."""
import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest

from posttrain.algos import from_archive
from posttrain.config import ConfigError
from posttrain.scheduling import archive

COLUMNS = archive.ARCHIVE_SCHEMA.names


def row(task, visit, sample, reward, completion, *, step=0, version=0, status=None, attempt=0, details=None,
        prompt=None):
    """One archive row of task `task` (prompt tokens [10 + task, 20, 30] unless given)."""
    r = dict.fromkeys(COLUMNS)
    r.update(episode_id=f"run:arith:{task}:{visit}:{sample}", attempt=attempt, run="run", domain="arith",
             task_index=task, visit=visit, sample=sample, try_index=0, retry_round=0, step=step,
             policy_version=version, task_id=f"arith-train-{task}", prompt_ids=prompt or [10 + task, 20, 30],
             completion_ids=list(completion), prompt="p", completion="c", reward=reward,
             status=status or ("ok" if reward == 1.0 else "wrong" if reward is not None else "infra_error"),
             truncated=False, in_batch=True, sampler_s=0.0, env_s=0.0, env_cost_s=0.0,
             details=json.dumps(details or {"turns": 1}))
    return r


ROWS = [  # step 0: task 0 has two distinct successes and a duplicate; task 1 one success and one failure
    row(0, 0, 0, 1.0, [40, 41]), row(0, 0, 1, 1.0, [40, 41]), row(0, 0, 2, 1.0, [42]), row(0, 0, 3, 0.0, [43]),
    row(1, 0, 0, 0.0, [50]), row(1, 0, 1, 1.0, [51, 52]),
    row(2, 0, 0, None, [60]), row(2, 0, 1, 1.0, [61], details={"turns": 2}),  # infra error; multi-turn
    row(3, 0, 0, 1.0, [70], details={"turns": 1, "split": "test"}),  # not the train split
    # step 1: task 0 again (visit 1, policy version 1): only failures; task 4: success and failure at version 1
    row(0, 1, 0, 0.0, [44], step=1, version=1), row(4, 0, 0, 1.0, [80], step=1, version=1),
    row(4, 0, 1, 0.0, [81], step=1, version=1),
]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    for step in (0, 1):
        archive.write_step(run, step, [r for r in ROWS if r["step"] == step])
    return run, archive.read(run)


def test_sft_examples_successful_distinct_and_at_most_k_per_prompt(table):
    _, t = table
    train, held, counts = from_archive.sft_examples(t, min_reward=1.0, max_per_prompt=1, max_len=16)
    got = [(ex.tokens_n.tolist(), ex.assistant_n.tolist()) for ex in train]
    assert got == [([10, 20, 30, 40, 41], [False] * 3 + [True] * 2), ([11, 20, 30, 51, 52], [False] * 3 + [True] * 2),
                   ([14, 20, 30, 80], [False] * 3 + [True])]
    assert held == []
    assert counts["archive/no_reward"] == 1 and counts["archive/multi_turn"] == 1
    assert counts["archive/not_train_split"] == 1 and counts["archive/over_max_per_prompt"] == 1
    assert counts["archive/duplicate_replies"] == 1 and counts["sft/examples"] == 3
    two, _, c2 = from_archive.sft_examples(t, max_per_prompt=2, max_len=16)
    assert [ex.tokens_n.tolist() for ex in two][:2] == [[10, 20, 30, 40, 41], [10, 20, 30, 42]]
    assert c2["sft/examples"] == 4 and c2["archive/over_max_per_prompt"] == 0
    assert from_archive.sft_examples(t, min_reward=2.0, max_len=16)[0] == []
    cut, _, c3 = from_archive.sft_examples(t, max_len=4)  # the replies cut to fit: task 0's keeps one token
    assert [len(ex.tokens_n) for ex in cut] == [4, 4, 4] and c3["sft/truncated"] == 2


def test_held_out_prompts_are_never_trained(table):
    _, t = table
    train, held, _ = from_archive.sft_examples(t, max_per_prompt=2, max_len=16, eval_fraction=0.5, seed=3)
    prompts = lambda exs: {tuple(ex.tokens_n[:3].tolist()) for ex in exs}
    assert held and train and not prompts(train) & prompts(held)
    tr, ev, _ = from_archive.dpo_pairs(t, eval_fraction=0.5, seed=3)
    assert tr and ev and not {tuple(p.prompt) for p in tr} & {tuple(p.prompt) for p in ev}


def test_dpo_pairs_come_from_one_group_and_one_policy_version(table):
    _, t = table
    pairs, held, counts = from_archive.dpo_pairs(t, max_pairs_per_group=1)
    got = [(p.prompt.tolist(), p.chosen.tolist(), p.rejected.tolist()) for p in pairs]
    # task 0 visit 0 (chosen its first success, sample 0), task 1, task 4; task 0 visit 1 has no success (its
    # failure is never paired with visit 0's successes: another group and policy version)
    assert got == [([10, 20, 30], [40, 41], [43]), ([11, 20, 30], [51, 52], [50]), ([14, 20, 30], [80], [81])]
    assert pairs[0].pair_id == "run:arith:0:0:0#0|run:arith:0:0:3#0" and held == []
    assert counts["archive/groups_with_pair"] == 3 and counts["dpo/train_pairs"] == 3
    short, _, _ = from_archive.dpo_pairs(t, max_prompt_len=2, max_completion_len=1)
    assert short[0].prompt.tolist() == [20, 30] and short[0].chosen.tolist() == [40] and short[0].truncated


def test_bad_tables_and_settings():
    import pyarrow as pa

    with pytest.raises(ValueError, match="missing columns.*'prompt_ids'"):
        from_archive.sft_examples(pa.table({"reward": [1.0]}))
    with pytest.raises(ValueError, match="max_per_prompt must be >= 1"):
        from_archive.sft_examples(archive.ARCHIVE_SCHEMA.empty_table(), max_per_prompt=0)


def test_config_and_recipe_errors_for_a_run_without_an_archive(tmp_path):
    from posttrain.config.dpo import default_dpo_config, dpo_config_from_dict
    from posttrain.config.sft import default_sft_config, sft_config_from_dict
    from posttrain.learn import offline_loop

    (tmp_path / "empty").mkdir()
    for load, default, name in ((sft_config_from_dict, default_sft_config, "sft"),
                                (dpo_config_from_dict, default_dpo_config, "dpo")):
        c = default()
        c[name].from_archive = str(tmp_path / "empty")
        with pytest.raises(ConfigError, match=rf"{name}.from_archive=.*empty.*no episode archive"):
            load(c)
        c[name].from_archive = str(tmp_path / "missing")
        with pytest.raises(ConfigError, match="no such run directory"):
            load(c)
    with pytest.raises(FileNotFoundError, match="has no episode archive"):
        from_archive.archive_table(tmp_path / "empty")


def test_the_recipes_read_a_runs_archive(table):
    from posttrain.algos.dpo.data import PairSettings
    from posttrain.algos.sft.data import DataSettings
    from posttrain.recipes import dpo, sft

    run, t = table
    # eval_fraction unset: ARCHIVE_EVAL_FRACTION of the archive's prompts held out by default, never trained on
    train, held, counts = sft.load_examples(DataSettings(from_archive=str(run), max_per_prompt=2, seq_len=16), None)
    want, want_held, _ = from_archive.sft_examples(t, max_per_prompt=2, max_len=16,
                                                   eval_fraction=from_archive.ARCHIVE_EVAL_FRACTION)
    assert [e.tokens_n.tolist() for e in train] == [e.tokens_n.tolist() for e in want]
    assert held and [e.tokens_n.tolist() for e in held] == [e.tokens_n.tolist() for e in want_held]
    assert not {tuple(e.tokens_n[:3].tolist()) for e in held} & {tuple(e.tokens_n[:3].tolist()) for e in train}
    pairs, _ = dpo.load_pairs(PairSettings(from_archive=str(run)), None)
    want_pairs = from_archive.dpo_pairs(t, eval_fraction=from_archive.ARCHIVE_EVAL_FRACTION)[0]
    assert [p.pair_id for p in pairs] == [p.pair_id for p in want_pairs]
    from posttrain.errors import DataError

    with pytest.raises(DataError, match=r"posttrain sft --from_archive=.*no successful reply.*lower --min_reward"):
        sft.load_examples(DataSettings(from_archive=str(run), min_reward=5.0), None)
    # nothing to pair: every reply of a group scored alike (here: every reply given the same reward)
    flat = t.set_column(t.schema.get_field_index("reward"), "reward", pa.array([1.0] * len(t), pa.float64()))
    for command in ("dpo", "rm"):
        with pytest.raises(DataError, match=rf"posttrain {command} --from_archive=.*no training pair.*scored 1 and"):
            monkeypatched_pairs(flat, command)


@pytest.mark.slow  # 76 s on 2 loaded cores (two tiny compiles); test_the_recipes_read_a_runs_archive covers the wiring
def test_sft_and_dpo_recipes_train_on_a_runs_archive(table, tmp_path):
    import importlib.util
    import pathlib

    from posttrain.config.dpo import dpo_config_from_dict
    from posttrain.config.sft import sft_config_from_dict
    from posttrain.recipes import dpo, sft

    root = pathlib.Path(__file__).resolve().parents[3]
    load = lambda name: importlib.util.spec_from_file_location(name, root / "configs" / f"{name}.py")
    run, _ = table
    for name, loader, make_plan, train, key in (("sft_tiny", sft_config_from_dict, sft.make_sft_plan, sft.train,
                                                 "sft/examples"),
                                                ("dpo_tiny", dpo_config_from_dict, dpo.make_dpo_plan, dpo.train,
                                                 "dpo/train_pairs")):
        spec = load(name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        c = module.get_config()
        section = c[name.split("_")[0]]
        section.train_examples, section.eval_examples, section.from_archive = (), (), str(run)
        c.train.steps = 2
        plan = make_plan(loader(c), workdir=str(tmp_path / name))
        summary = train(plan, progress=False)
        assert summary["end_step"] == 2, summary
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert any(np.isfinite(r.get(f"{name.split('_')[0]}/loss", np.nan)) for r in rows)


@pytest.mark.parametrize("command,extra,msg", [
    ("sft", (), r"sft.from_archive=.*no episode archive"),
    ("dpo", (), r"dpo.from_archive=.*no episode archive"),
    ("dpo", ("--min_reward=1",), r"--min_reward applies to sft --from_archive only"),
])
def test_cli_from_archive_errors_are_one_line(tmp_path, capsys, command, extra, msg):
    from absl import flags

    from posttrain import cli

    (tmp_path / "run").mkdir()
    argv = ["posttrain", command, f"--from_archive={tmp_path / 'run'}", "--noprogress", *extra]
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # a usage error: one line
        rc, err = 2, str(e.code)
    else:
        err = capsys.readouterr().err
    finally:
        flags.FLAGS.unparse_flags()
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert __import__("re").search(msg, err), err
    assert not (tmp_path / "run" / "config.json").exists()


def test_cli_help_lists_the_archive_flags(capsys):
    from absl import flags

    from posttrain import cli

    for command, names in (("sft", ("from_archive", "min_reward", "max_per_prompt")), ("dpo", ("from_archive",))):
        try:
            cli.main(["posttrain", command, "--help"])
        except SystemExit:
            pass
        finally:
            flags.FLAGS.unparse_flags()
        out = capsys.readouterr().out
        assert all(f"--{n}=" in out for n in names) and f"posttrain {command}    --from_archive=RUN" in out, out
    assert "--max_per_prompt" not in out  # dpo's help: the sft-only flag is not listed


def test_several_runs_archives_are_read_as_one_and_their_groups_stay_apart(tmp_path):
    """from_archive="A,B" (e.g. the seeds of one config): the archives in order, one table; a pair never joins
    replies of two runs (the group key has the run); two archives of one run name, a run named twice, a missing
    run and runs of different models are clear errors."""
    from posttrain.cli.commands import UsageError, _archive_model
    from posttrain.config.sft import archive_runs, check_archive
    from posttrain.learn import offline_loop

    def write(name, run_name, model):
        d = tmp_path / name
        for step in (0, 1):
            rows = [{**r, "run": run_name, "episode_id": r["episode_id"].replace("run:", f"{run_name}:")}
                    for r in ROWS if r["step"] == step]
            archive.write_step(d, step, rows)
        (d / "config.json").write_text(json.dumps({"model": model}))
        return str(d)

    a, b = write("s0", "s0", {"preset": "tiny"}), write("s1", "s1", {"preset": "tiny"})
    assert archive_runs(f" {a}, {b},") == [a, b]
    check_archive(f"{a},{b}", "dpo.from_archive")
    both = from_archive.archive_table(f"{a},{b}")
    assert both.column("run").to_pylist() == ["s0"] * len(ROWS) + ["s1"] * len(ROWS)
    pairs = from_archive.dpo_pairs(both)[0]
    one = from_archive.dpo_pairs(from_archive.archive_table(a))[0]
    assert len(pairs) == 2 * len(one) and all(p.pair_id.count("s0:") in (0, 2) for p in pairs)
    assert _archive_model(f"{a},{b}", {}) == {"preset": "tiny"}
    c = write("s2", "s0", {"preset": "tiny"})
    with pytest.raises(ValueError, match="both hold run 's0'"):
        from_archive.archive_table(f"{a},{c}")
    with pytest.raises(ConfigError, match="named twice"):
        check_archive(f"{a},{a}", "sft.from_archive")
    with pytest.raises(ConfigError, match=r"'.*missing': no such run directory"):
        check_archive(f"{a},{tmp_path / 'missing'}", "rm.from_archive")
    d = write("s3", "s3", {"preset": "tiny-dense"})
    with pytest.raises(UsageError, match="different `model` sections"):
        _archive_model(f"{a},{d}", {})


def monkeypatched_pairs(table, command):
    """`dpo.load_pairs` of an archive table given in memory (the recipe reads it through `archive_table`)."""
    from unittest import mock

    from posttrain.algos.dpo.data import PairSettings
    from posttrain.recipes import dpo

    with mock.patch.object(from_archive, "archive_table", lambda run: table):
        return dpo.load_pairs(PairSettings(from_archive="run"), None, command)
