"""posttrain.eval.suite: suite files parse into domains by area, bad suites raise one clear error, --limit and
--domains select, and domains whose data is absent or whose golden check fails are skipped with a reason."""
import pathlib

import pytest

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
    assert all(d.n >= 2 * k for d in s.domains for k in d.ks)
    assert {d.area for d in s.domains} >= ({"agentic"} if path.stem == "agentic" else {"arithmetic"})


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
    ({"n": 2, "k": [2], "temperature": 1.0}, r"n >= 2k.*n=2 for k=\[2\]"),
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
    from envs.tasks import domains as registry

    real = registry.check_domain

    def check(domain, **kw):  # leg_counting's golden check "fails" here
        c = real(domain, **kw)
        return c if domain != "reasoning_gym/leg_counting" else registry.DomainCheck(domain, "failed", "", "ref 0", "")

    monkeypatch.setattr(registry, "check_domain", check)
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
    s = suite_lib.parse_suite(_suite(kwargs={"digits": 1, "num_test": 20, "bogus": 1}))
    with pytest.raises(TypeError, match="bogus"):
        suite_lib.resolve(s)
