"""Gaming floors and golden samples (envs/tasks/probes.py, floors.py): the probe math against a NumPy reference, five
domains recomputed against the stored table, the flags selection reads, and configs/reasoning_mix.py's selection."""
import importlib.util
import pathlib

import numpy as np
import pytest

from envs.tasks import domains, floors, probes

ROOT = pathlib.Path(__file__).resolve().parents[3]
# (domain, flagged by floor, golden sample status): the measured facts of issue 22 on reasoning-gym 0.1.25
RECOMPUTED = [("reasoning_gym/coin_flip", True, "passed"), ("reasoning_gym/game_of_life_halting", True, "passed"),
              ("reasoning_gym/letter_counting", True, "passed"), ("reasoning_gym/rush_hour", False, "unverified"),
              ("reasoning_gym/spell_backward", False, "passed")]


def _tasks(n=6):
    return [{"id": f"t{i}", "question": f"What is {i} + 0?", "answer": str(i % 3)} for i in range(n)]


@pytest.mark.parametrize("paid,want_probe", [
    (lambda t, r: float(r == "<answer>0</answer>"), "constant:0"),            # a constant the scorer pays for
    (lambda t, r: float(t["question"] in r and "<answer>" in r), "question"),  # the question copied back
    (lambda t, r: float(r == ""), "empty"),
    (lambda t, r: 0.5 * ("<answer>" in r), "format_only"),                     # format credit: the first paid probe
    (lambda t, r: float(r.count(",") >= 2 and t["answer"] in r), "candidates"),
])
def test_floor_is_the_best_probe_mean_numpy_reference(paid, want_probe):
    tasks = _tasks()
    replies = probes.probe_replies(tasks, "<answer>{}</answer>")
    floor, best, means = probes.floor_of(paid, tasks, replies)
    ref = np.array([[paid(t, make(t)) for t in tasks] for make in replies.values()]).mean(axis=1)
    assert floor == pytest.approx(ref.max()) and best == want_probe
    assert list(means.values()) == pytest.approx(ref.tolist())
    assert {"empty", "format_only", "constant:0", "constant:yes", "constant:False", "question"} <= set(replies)


def test_the_floor_is_the_held_out_mean_of_the_probe_chosen_on_train():
    train, test = _tasks(6), _tasks(9)[6:]
    pays = lambda t, r: float(r == "<answer>0</answer>") if t in train else float(r == "")  # noqa: E731
    replies = probes.probe_replies(train, "<answer>{}</answer>")
    floor, best, means = probes.floor_of(pays, test, replies, select_on=train)
    assert (best, floor, means["empty"]) == ("constant:0", 0.0, 1.0)  # chosen on train, measured held out
    assert probes.floor_of(pays, test, replies)[:2] == (1.0, "empty")  # without select_on: the max on `tasks`


def test_golden_sample_statuses():
    tasks = _tasks(4)
    exact = lambda t, r: float(r == t["answer"])  # noqa: E731
    assert probes.golden_sample(exact, tasks, lambda t: t["answer"]) == ("passed", 4, 0, "")
    status, checked, failures, reason = probes.golden_sample(exact, tasks, lambda t: "1")
    assert (status, checked, failures) == ("failed", 4, 3) and reason.startswith("3/4 reference replies below 1: t0")
    assert probes.golden_sample(exact, tasks, lambda t: None)[0] == "unverified"
    with pytest.raises(ValueError, match="0 tasks"):
        probes.floor_of(exact, [], {"empty": lambda t: ""})


@pytest.fixture(scope="module")
def table():
    return floors.load_table()


@pytest.mark.parametrize("domain,by_floor,golden", RECOMPUTED)
def test_five_domains_recomputed_agree_with_the_stored_table(table, domain, by_floor, golden):
    fresh = floors.assess(domain, domains.default_config(domain))
    stored = floors.lookup(domain, fresh.config, table)
    assert stored is not None, f"{domain}: no row for its default config in {floors.TABLE_PATH}"
    assert (round(fresh.floor, 4), fresh.probe, fresh.golden) == (stored.floor, stored.probe, stored.golden)
    assert (fresh.floor >= floors.FLOOR_THRESHOLD) == by_floor and fresh.golden == golden
    assert bool(floors.flag_reason(fresh)) == (by_floor or golden != "passed")


def test_measured_floors_of_the_issue(table):
    rows = table["domains"]
    assert rows["reasoning_gym/coin_flip"]["floor"] == pytest.approx(0.95)
    assert rows["reasoning_gym/game_of_life_halting"]["floor"] == 1.0
    assert rows["reasoning_gym/letter_counting"]["floor"] == pytest.approx(0.30)


def test_the_table_covers_the_registry_at_the_installed_version(table):
    assert table["schema_version"] == floors.SCHEMA_VERSION and table["reasoning_gym"] == floors.library_version()
    assert sorted(table["domains"]) == domains.registered_domains()
    for name in ("arithmetic", "gsm8k", "humaneval", "python_tool", "terminal", "agentic/repo_fix"):
        assert table["domains"][name]["golden"] in ("passed", "skipped"), name
    text = floors.format_floors([floors.row_assessment(d, r) for d, r in table["domains"].items()])
    assert text.splitlines()[-1].startswith(f"{len(table['domains'])} domains: ")


def test_select_leaves_flagged_domains_out_unless_a_config_opts_in():
    specs, left_out = domains.select("reasoning_gym/coin_flip,reasoning_gym/spell_backward")
    assert list(specs) == ["reasoning_gym/spell_backward"]
    assert left_out["reasoning_gym/coin_flip"].status == "flagged"
    assert "floor 0.95 >= 0.2 (constant:0)" in left_out["reasoning_gym/coin_flip"].reason
    specs, _ = domains.select([{"pattern": "reasoning_gym/coin_flip", "allow_flagged": True}])
    assert list(specs) == ["reasoning_gym/coin_flip"]
    assert list(domains.select("reasoning_gym/coin_flip", allow_flagged=True)[0]) == ["reasoning_gym/coin_flip"]
    with pytest.raises(ValueError, match=r"no trainable domain.*coin_flip \(flagged: floor 0.95"):
        domains.select("reasoning_gym/coin_flip")


def test_reasoning_mix_trains_only_on_domains_that_pass():
    spec = importlib.util.spec_from_file_location("reasoning_mix", ROOT / "configs" / "reasoning_mix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    assert cfg.env.train and set(cfg.env.train) == set(cfg.env.eval)
    for name, env in cfg.env.train.items():
        a = floors.assessment(name, env.kwargs["config"])
        assert not floors.flag_reason(a), (name, floors.flag_reason(a))
    assert "reasoning_gym/letter_counting" not in cfg.env.train  # its easy config's floor: 0.75 ("1")


HASH_DEPENDENT_SAMPLE = "reasoning_gym/isomorphic_strings,reasoning_gym/ransom_note"


def _floors(hash_seed):
    """The floor lines `python -m posttrain.cli domains --floors` prints for two hash-dependent datasets, under
    `hash_seed` (None: unset, as a user's shell leaves it)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "domains", "--floors",
                          f"--pattern={HASH_DEPENDENT_SAMPLE}"], capture_output=True, text=True, timeout=300,
                         env=env, cwd=ROOT).stdout
    return [line for line in out.splitlines() if line.startswith("reasoning_gym/")]


@pytest.mark.ci
def test_the_command_fixes_str_hashing_so_every_process_builds_the_same_tasks(table):
    """isomorphic_strings and ransom_note build other tasks under another str hash seed (their floors move: 0.50 /
    0.45 under seed 2, 0.55 / 0.55 under 3); the posttrain command sets PYTHONHASHSEED=0 itself, so a run from a
    shell without it builds the tasks, and the floors, the stored table holds."""
    assert _floors("2") != _floors("3")
    unset = _floors(None)
    assert unset == _floors("0") and len(unset) == 2
    for line in unset:
        domain, floor = line.split()[:2]
        assert float(floor) == pytest.approx(table["domains"][domain]["floor"])


def test_a_dataset_that_another_process_would_rebuild_differently_warns(monkeypatch):
    from envs.tasks import reasoning_gym

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(reasoning_gym, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="isomorphic_strings: its tasks depend on str hashing"):
        reasoning_gym.build_dataset("isomorphic_strings", {}, seed=0, size=2)
    with pytest.warns(RuntimeWarning, match="list_functions: the library builds its items differently"):
        reasoning_gym.build_dataset("list_functions", {}, seed=0, size=2)


@pytest.mark.slow  # 70 s: every flagged or budget-limited reasoning-gym row; the five above run in the CI tiers
def test_every_flagged_or_slow_domain_recomputed_agrees_with_the_table(table):
    """Under the command's hash seed, a fresh assessment equals the stored row for every reasoning-gym domain whose
    stored floor flags it or whose generation limited its sample, but list_functions, whose items vary per build."""
    import json
    import subprocess
    import sys

    code = ("import json; from envs.tasks import floors; t = floors.load_table()['domains']; "
            "names = sorted(d for d, r in t.items() if d.startswith('reasoning_gym/') and d != "
            "'reasoning_gym/list_functions' and ((r['floor'] or 0) >= 0.2 or (r.get('sampled') or 99) < 20)); "
            "print(json.dumps({a.domain: [a.floor if a.floor is None else round(a.floor, 4), a.probe] "
            "for a in floors.assess_all(names)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env={**__import__("os").environ, "PYTHONHASHSEED": "0"})
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    rows = table["domains"]
    assert len(fresh) >= 25
    assert {d: v for d, v in fresh.items() if v != [rows[d]["floor"], rows[d]["probe"]]} == {}
    assert all((v[0] or 0) >= 0.2 for d, v in fresh.items() if (rows[d]["floor"] or 0) >= 0.2)
