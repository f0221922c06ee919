"""Reading what a step of scripts/accelerator_check.py left: a bench's JSON line, pytest's JUnit XML, the step's
status. Pure functions of their inputs (tests/bench/test_accelerator_check.py checks each case)."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET


def last_json(stdout: str) -> dict | None:
    """The last line of `stdout` that parses as a JSON object (the benches print one), else None."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def junit_result(path: str) -> dict | None:
    """Counts and failures (test id, first line of the message) from pytest's JUnit XML, None when absent or cut
    short (a process killed while writing it). A module that failed to import (pytest's "collection failure": the
    device image lacks a dev dependency such as ray or nbformat; the step runs pytest with
    --continue-on-collection-errors) is listed in `collection_errors` and counted in none of the other fields."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failures, collection_errors = [], []
    for case in suite.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is None:
            continue
        test = f"{case.get('classname')}::{case.get('name')}"
        if bad.tag == "error" and bad.get("message") == "collection failure":
            lines = [line for line in (bad.text or "").strip().splitlines() if line.startswith("E ")]
            collection_errors.append({"module": case.get("name") or test, "message": (lines or [""])[-1][:300]})
            continue
        message = (bad.get("message") or bad.text or "").strip().splitlines()
        failures.append({"test": test, "message": message[0][:300] if message else ""})
    n["tests"] -= len(collection_errors)
    n["errors"] -= len(collection_errors)
    return {"collected": n["tests"], "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
            "failed": n["failures"], "errors": n["errors"], "skipped": n["skipped"], "failures": failures,
            "collection_errors": collection_errors, "seconds": float(suite.get("time", 0.0))}


MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def collection_blockers(result: dict) -> list[dict]:
    """The collection errors that are not a third-party package the image lacks (`ModuleNotFoundError` of a
    module outside this checkout: the tests step lists those apart and passes, e.g. ray and nbformat on the H200
    image); anything else (a syntax error, a failing import of posttrain itself) fails the step."""
    def missing_package(err: dict) -> bool:
        m = MISSING_MODULE.search(err["message"])
        return m is not None and m.group(1).split(".")[0] not in ("posttrain", "tests", "bench", "scripts", "envs")

    return [err for err in result.get("collection_errors", []) if not missing_package(err)]


def dotted(obj, path: str):
    """obj[a][b]... for path "a.b...", None where a key is missing."""
    for key in path.split("."):
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def step_status(name: str, rc: int | None, result: dict | None) -> str:
    """"timeout" (rc None), "empty" (tests: none carries the marker), "ok" or "failed". A bench is ok when it
    exits 0 with a JSON line; the tests when every collected test passed or was skipped and the only modules
    pytest could not import need a package the image lacks (pytest then exits 1; `collection_blockers`)."""
    if rc is None:
        return "timeout"
    if name == "tests" and result is not None:
        if result["collected"] == 0:
            return "empty"  # pytest exits 5: no test carries the marker
        clean = not (result["failed"] or result["errors"] or collection_blockers(result))
        return "ok" if clean and rc == (1 if result["collection_errors"] else 0) else "failed"
    return "ok" if rc == 0 and result is not None else "failed"
