"""`posttrain domains`: lists matching domains with golden-check status; a bad pattern is one error line."""
import pytest

from posttrain import cli


def test_domains_lists_status_and_sample(capsys):
    assert cli.main(["posttrain", "domains", "--pattern=reasoning_gym/gcd,reasoning_gym/rush_hour"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("reasoning_gym/gcd") and " verified " in lines[0] and "Find the Greatest" in lines[0]
    assert lines[1].startswith("reasoning_gym/rush_hour") and " unverified " in lines[1]
    assert lines[-1] == "2 domains: 1 verified, 0 verified_reference_free, 1 unverified, 0 failed"


def test_domains_bad_pattern_is_one_error():
    with pytest.raises(SystemExit, match=r"error: domain pattern 'zzz' matches no domain"):
        cli.main(["posttrain", "domains", "--pattern=zzz"])
