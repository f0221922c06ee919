"""`posttrain domains`: lists matching domains with golden-check status and the floor table's flags; --floors
computes floors and golden samples; a bad pattern is one error line."""

from posttrain import cli


def test_domains_lists_status_and_sample(capsys):
    assert cli.main(["posttrain", "domains", "--pattern=reasoning_gym/gcd,reasoning_gym/rush_hour"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("reasoning_gym/gcd") and " verified " in lines[0] and "Find the Greatest" in lines[0]
    rush = next(i for i, line in enumerate(lines) if line.startswith("reasoning_gym/rush_hour"))
    assert " unverified " in lines[rush]
    assert any("flagged (floor table): floor 0.35 >= 0.2 (constant:2)" in line for line in lines[1:rush])
    assert lines[-2] == "2 flagged by the floor table (posttrain domains --floors; left out of mixes)"
    assert lines[-1] == "2 domains: 1 verified, 0 verified_reference_free, 1 unverified, 0 failed"


def test_domains_floors_flags_gaming_and_unverified_domains(capsys):
    assert cli.main(["posttrain", "domains", "--floors",
                     "--pattern=reasoning_gym/coin_flip,reasoning_gym/rush_hour,reasoning_gym/spell_backward"]) == 0
    out = capsys.readouterr().out
    assert "^ FLAGGED: floor 0.95 >= 0.2 (constant:0)" in out and "^ FLAGGED: golden sample unverified" in out
    assert out.strip().splitlines()[-1] == ("3 domains: 2 flagged (1 by floor >= 0.2, 0 failing golden sample, "
                                            "1 unverified); 0 skipped")


def test_domains_bad_pattern_is_one_error(capsys):
    assert cli.main(["posttrain", "domains", "--pattern=zzz"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: domain pattern 'zzz' matches no domain") and len(err.splitlines()) == 1, err
    assert cli.main(["posttrain", "domains", "--floors", "--pattern=zzz"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --pattern='zzz' matches no domain") and len(err.splitlines()) == 1, err
