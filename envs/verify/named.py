"""Verifiers selected by name, with arguments, combined with weights: one model reply against one task-file row.

`parse_verifier` reads a config value ("numeric", {"name": "regex", "pattern": "..."} or a list of these),
`check_row` says what a row lacks, `score` gives the weighted verdict of a reply and `reference_reply` a reply
that scores 1. The verifier functions live in `envs.verify.row_verifiers`; their rules and measured replies:
docs/verifiers.md. Pure, no JAX; `score` never raises on a reply and is bounded in time.
"""
from __future__ import annotations

import dataclasses
import json
import string
from collections.abc import Callable, Mapping
from typing import Any

import jsonschema
import regex

from envs.verify import answers, code_rows, row_verifiers

MODEL_GRADED = ("rubric", "reward_model")
_SPEC_KEYS = ("name", "weight")


@dataclasses.dataclass(frozen=True)
class VerifierSpec:
    """One verifier as configured.

    Attributes:
        name: a key of VERIFIERS.
        args: its validated arguments, every one present (defaults filled in).
        weight: its weight in the weighted mean (> 0).
    """

    name: str
    args: Mapping[str, Any]
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class Scored:
    """The outcome of `score`.

    Attributes:
        verdict: reward = the weighted mean of the computed parts, in [0, 1]; status "ok" when it is 1.
        parts: verifier name (``name#i`` for the i-th of a repeated name) -> its reward, for the computed verifiers.
        model_graded: the specs a model scores later (rubric, reward_model), left out of the mean.
    """

    verdict: answers.Verdict
    parts: Mapping[str, float]
    model_graded: tuple[VerifierSpec, ...]


@dataclasses.dataclass(frozen=True)
class Verifier:
    """A named verifier: how it scores, what it reads, what a passing reply looks like.

    Attributes:
        fn: ``(reply, row, *, bound_s, **args) -> Verdict``; None when a model grades it.
        reference: ``(row, args) -> reply`` that should score 1, or None.
        fields: ``args -> the row fields it needs``.
        check: ``(row, args) -> ""`` or the row's problem in one phrase (its fields are present).
        args: argument name -> (default, ``value -> ""`` or what the value should be).
        model_graded: scored later by a model, not by `score`.
        doc: one line.
    """

    fn: Callable[..., answers.Verdict] | None
    reference: Callable[[Mapping, Mapping], str | None]
    fields: Callable[[Mapping], tuple[str, ...]]
    check: Callable[[Mapping, Mapping], str]
    args: Mapping[str, tuple[Any, Callable[[Any], str]]]
    model_graded: bool = False
    doc: str = ""


# --------------------------------------------------------------------------------------------- argument checks
def _bool(v) -> str:
    return "" if isinstance(v, bool) else "a bool"


def _non_negative(v) -> str:
    return "" if row_verifiers.finite(v) and v >= 0 else "a finite number >= 0"


def _seconds(v) -> str:
    return "" if row_verifiers.finite(v) and 0 < v <= 600 else "a number of seconds in (0, 600]"


def _one_of(options: tuple[str, ...]) -> Callable[[Any], str]:
    return lambda v: "" if isinstance(v, str) and v in options else f"one of {', '.join(options)}"


def _methods(v) -> str:
    ok = isinstance(v, (list, tuple)) and v and all(isinstance(m, str) and m in answers.METHODS for m in v)
    return "" if ok else f"a non-empty list from {', '.join(answers.METHODS)}"


def _flags(v) -> str:
    return "" if isinstance(v, str) and set(v) <= set("ims") else 'a str of the letters "i", "m", "s"'


def _regex_error(pattern) -> str:
    if not isinstance(pattern, str):
        return "not a str"
    try:
        regex.compile(pattern)
    except Exception as exc:  # noqa: BLE001 - regex.error, and whatever an odd pattern raises
        return str(exc)[:80]
    return ""


def _pattern(v) -> str:
    why = "" if v is None else _regex_error(v)
    return f"a regex that compiles ({why})" if why else ""


def _choices(v) -> str:
    if v is None or (isinstance(v, int) and not isinstance(v, bool) and 2 <= v <= 26):
        return ""
    ok = isinstance(v, str) and 2 <= len(v) <= 26 and set(v.upper()) <= set(string.ascii_uppercase)
    return "" if ok and len(set(v.upper())) == len(v) else "a count 2-26 or a str of distinct letters"


def _schema_error(schema) -> str:
    if not isinstance(schema, Mapping):
        return "not a dict"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return exc.message[:80]
    return ""


def _schema(v) -> str:
    why = "" if v is None else _schema_error(v)
    return f"a valid JSON schema ({why})" if why else ""


def _fields(v) -> str:
    ok = v is None or (isinstance(v, (list, tuple)) and v and all(isinstance(f, str) for f in v))
    return "" if ok else "a non-empty list of keys"


# --------------------------------------------------------------------------------------------- row checks
def _needs(*fields: str) -> Callable[[Mapping], tuple[str, ...]]:
    return lambda args: fields


def _row_exact(row, args) -> str:
    a = row["answer"]
    ok = (isinstance(a, str) and a.strip()) or (
        isinstance(a, (list, tuple)) and a and all(isinstance(x, str) and x.strip() for x in a))
    return "" if ok else "'answer' must be a non-empty str or list of str"


def _row_numeric(row, args) -> str:
    return "" if row_verifiers.gold_number(row["answer"]) is not None else f"'answer' {row['answer']!r:.40} is not a number"


def _row_math(row, args) -> str:
    if not (isinstance(row["answer"], str) or row_verifiers.finite(row["answer"])):
        return "'answer' must be a str or a number"
    try:
        answers.gold_answer(str(row["answer"]))
    except ValueError as exc:
        return str(exc)[:80]
    return ""


def _row_regex(row, args) -> str:
    why = "" if args["pattern"] is not None else _regex_error(row["pattern"])
    return f"'pattern' is not a regex that compiles ({why})" if why else ""


def _row_choice(row, args) -> str:
    listed = row.get("choices")
    if listed is not None and not (isinstance(listed, (list, tuple)) and 2 <= len(listed) <= 26):
        return "'choices' must be a list of 2 to 26 choices"
    return row_verifiers.choice_gold(row, row_verifiers.choice_letters(row, args["choices"]))[1]


def _row_json(row, args) -> str:
    gold, schema = row.get("answer"), args["schema"]
    if gold is None:
        return "" if schema is not None else "needs an 'answer' dict or a schema"
    if not isinstance(gold, Mapping):
        return "'answer' must be a dict (a JSON object)"
    missing = [f for f in args["fields"] or () if f not in gold]
    if missing:
        return f"'answer' has no field {missing[0]!r}"
    error = None if schema is None else next(jsonschema.validators.validator_for(schema)(schema).iter_errors(gold),
                                             None)
    return f"'answer' does not fit the schema: {error.message[:60]}" if error is not None else ""


def _row_code(row, args) -> str:
    tests, entry, solution = row["tests"], row.get("entry_point"), row.get("solution")
    if not isinstance(tests, str) or not tests.strip():
        return "'tests' must be non-empty Python source"
    try:
        compile(tests, "<tests>", "exec")  # parsed only, never run here
    except Exception as exc:  # noqa: BLE001 - SyntaxError, ValueError (NUL bytes), RecursionError
        return f"'tests' do not compile: {exc!r:.80}"
    if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
        return "'entry_point' must be a Python identifier"
    return "" if solution is None or isinstance(solution, str) else "'solution' must be a str"


def _row_rubric(row, args) -> str:
    rubric = row["rubric"]
    if isinstance(rubric, str):
        return "" if rubric.strip() else "'rubric' is empty"
    if not isinstance(rubric, (list, tuple)) or not rubric:
        return "'rubric' must be a non-empty str or list of criteria"
    for i, c in enumerate(rubric):
        if not (isinstance(c, Mapping) and isinstance(c.get("name"), str) and isinstance(c.get("description"), str)):
            return f"rubric criterion {i} needs a str 'name' and 'description'"
        if not row_verifiers.finite(c.get("weight", 1.0)) or not c.get("weight", 1.0) > 0:
            return f"rubric criterion {i}: weight must be a number > 0"
    return ""


# --------------------------------------------------------------------------------------------- references
def _ref_exact(row, args) -> str:
    a = row_verifiers.accepted_answers(row["answer"])[0]
    return {"auto": f"<answer>{a}</answer>", "answer_tag": f"<answer>{a}</answer>", "hash": f"#### {a}",
            "boxed": f"\\boxed{{{a}}}"}.get(args["extract"], a)


def _ref_math(row, args) -> str:
    gold = answers.gold_answer(str(row["answer"]))
    return f"#### {gold}" if "hash" in args["methods"] else f"\\boxed{{{gold}}}" if "boxed" in args["methods"] else gold


def _ref_regex(row, args) -> str | None:
    for key in ("example", "answer"):
        example = row.get(key)
        if isinstance(example, str) and example.strip():
            return example if args["mode"] == "search" else f"<answer>{example}</answer>"
    return None


def _ref_json(row, args) -> str | None:
    gold = row.get("answer")
    return f"```json\n{json.dumps(dict(gold))}\n```" if isinstance(gold, Mapping) else None


def _ref_code(row, args) -> str | None:
    return f"```python\n{row['solution']}\n```" if isinstance(row.get("solution"), str) else None


def _ref_numeric(row, args) -> str:
    return f"<answer>{row['answer']}</answer>"


def _ref_choice(row, args) -> str | None:
    letter = row_verifiers.choice_gold(row, row_verifiers.choice_letters(row, args["choices"]))[0]
    return None if letter is None else f"<answer>{letter}</answer>"


def _no_reference(row, args) -> None:
    return None


VERIFIERS: dict[str, Verifier] = {
    "exact": Verifier(
        row_verifiers.verify_exact, _ref_exact, _needs("answer"), _row_exact,
        {"case_sensitive": (False, _bool), "strip_punctuation": (False, _bool),
         "extract": ("auto", _one_of(row_verifiers.EXTRACT_MODES))},
        doc="the extracted answer equals row['answer']"),
    "numeric": Verifier(
        row_verifiers.verify_numeric, _ref_numeric, _needs("answer"), _row_numeric,
        {"tolerance": (0.0, _non_negative), "rel_tolerance": (1e-9, _non_negative), "units": (True, _bool)},
        doc="the reply's number is row['answer'], within tolerance"),
    "math": Verifier(
        row_verifiers.verify_math, _ref_math, _needs("answer"), _row_math, {"methods": (answers.METHODS, _methods)},
        doc="answers.score_math against row['answer']"),
    "regex": Verifier(
        row_verifiers.verify_regex, _ref_regex, lambda args: () if args["pattern"] is not None else ("pattern",), _row_regex,
        {"pattern": (None, _pattern), "mode": ("fullmatch", _one_of(("fullmatch", "search"))), "flags": ("", _flags)},
        doc="a pattern matches the extracted answer or the reply"),
    "choice": Verifier(
        row_verifiers.verify_choice, _ref_choice, _needs("answer"), _row_choice, {"choices": (None, _choices)},
        doc="the one chosen letter is row['answer']"),
    "json": Verifier(
        row_verifiers.verify_json, _ref_json, lambda args: ("answer",) if args["schema"] is None else (), _row_json,
        {"schema": (None, _schema), "fields": (None, _fields), "numeric_tolerance": (0.0, _non_negative)},
        doc="the last JSON value fits the schema and equals row['answer'] on its fields"),
    "code_tests": Verifier(
        code_rows.verify_code_tests, _ref_code, _needs("tests"), _row_code, {"timeout_s": (10.0, _seconds)},
        doc="the last python block passes row['tests'] in the sandbox"),
    "rubric": Verifier(
        None, _no_reference, _needs("rubric"), _row_rubric, {}, model_graded=True,
        doc="a grader model scores the reply against row['rubric']"),
    "reward_model": Verifier(
        None, _no_reference, _needs(), lambda row, args: "", {}, model_graded=True,
        doc="a reward model scores the reply"),
}


# --------------------------------------------------------------------------------------------- public API
def _parse_one(item) -> VerifierSpec:
    if isinstance(item, VerifierSpec):
        item = {**item.args, "name": item.name, "weight": item.weight}
    elif isinstance(item, str):
        item = {"name": item}
    if not isinstance(item, Mapping):
        raise ValueError(  # noqa: TRY004 - config errors are ValueErrors, whatever their cause
            f"verifier: a spec is a name or a mapping with 'name', got {type(item).__name__} {item!r:.60}")
    name = item.get("name")
    if not isinstance(name, str) or name not in VERIFIERS:
        raise ValueError(f"verifier: unknown name {name!r}; valid names: {', '.join(VERIFIERS)}")
    verifier, weight = VERIFIERS[name], item.get("weight", 1.0)
    valid = ", ".join((*_SPEC_KEYS, *verifier.args))
    if not row_verifiers.finite(weight) or not weight > 0:
        raise ValueError(f"verifier {name!r}: weight must be a number > 0, got {weight!r}")
    for key, value in item.items():
        if key in _SPEC_KEYS:
            continue
        if key not in verifier.args:
            raise ValueError(f"verifier {name!r}: unknown argument {key!r}; valid keys: {valid}")
        expected = verifier.args[key][1](value)
        if expected:
            raise ValueError(f"verifier {name!r}: {key}={value!r:.60} is invalid, expected {expected}; "
                             f"valid keys: {valid}")
    args = {key: item.get(key, default) for key, (default, _) in verifier.args.items()}
    args.update({k: tuple(v) for k, v in args.items() if isinstance(v, list)})  # methods, fields
    return VerifierSpec(name, args, float(weight))


def parse_verifier(spec) -> tuple[VerifierSpec, ...]:
    """The validated specs of a config value, defaults filled in.

    Args:
      spec: a name ("numeric"), a mapping ``{"name": ..., "weight": 0.5, **args}``, a `VerifierSpec`, or a
        non-empty list/tuple of these.

    Raises:
      ValueError: one line naming the verifier, the bad key or value and the valid keys or names: an unknown name
        or argument, an argument of the wrong type or range, a weight <= 0, an empty list.
    """
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not items:
        raise ValueError(f"verifier: empty list; give at least one of {', '.join(VERIFIERS)}")
    return tuple(_parse_one(item) for item in items)


def required_fields(specs) -> tuple[str, ...]:
    """The row fields these verifiers need, in order, each once: ("answer",), ("tests",). ValueError on bad specs."""
    fields: dict[str, None] = {}
    for spec in parse_verifier(specs):
        fields.update(dict.fromkeys(VERIFIERS[spec.name].fields(spec.args)))
    return tuple(fields)


def check_row(specs, row: Mapping) -> str:
    """The row's first problem for these verifiers in one short phrase, named by verifier; "" when there is none.

    Problems: a missing field, a wrong type, a regex that does not compile, an answer that does not fit the JSON
    schema, a choice answer not among the choices, tests that do not parse. Raises ValueError on bad specs only."""
    specs = parse_verifier(specs)
    if not isinstance(row, Mapping):
        return f"the row is a {type(row).__name__}, not a mapping"
    for spec in specs:
        verifier = VERIFIERS[spec.name]
        missing = [f for f in verifier.fields(spec.args) if f not in row]
        problem = f"row has no {missing[0]!r}" if missing else verifier.check(row, spec.args)
        if problem:
            return f"{spec.name}: {problem}"
    return ""


def _part_keys(specs: list[VerifierSpec]) -> list[str]:
    names = [s.name for s in specs]
    seen: dict[str, int] = {}
    keys = []
    for name in names:
        keys.append(f"{name}#{seen.get(name, 0)}" if names.count(name) > 1 else name)
        seen[name] = seen.get(name, 0) + 1
    return keys


def _run(spec: VerifierSpec, reply, row, timeout_s: float, code_runner) -> answers.Verdict:
    extra = {"code_runner": code_runner} if spec.name == "code_tests" else {}
    try:
        verdict = VERIFIERS[spec.name].fn(reply, row, bound_s=timeout_s, **spec.args, **extra)
    except Exception as exc:  # noqa: BLE001 - a malformed reply scores 0 with a reason
        return answers.Verdict(0.0, "wrong", reason=f"verifier error: {exc!r}"[:row_verifiers.MAX_REASON_CHARS])
    if len(verdict.reason) > row_verifiers.MAX_REASON_CHARS:
        verdict = dataclasses.replace(verdict, reason=verdict.reason[:row_verifiers.MAX_REASON_CHARS])
    return verdict


def score(specs, reply, row: Mapping, *, timeout_s: float = answers.DEFAULT_TIMEOUT_S,
          code_runner: code_rows.CodeRunner | None = None) -> Scored:
    """Score one reply against one row with every verifier this process computes; never raises on the reply.

    reward = sum(w_i * r_i) / sum(w_i) over the computed specs; status "ok" when it is 1, else the first failing
    part's status, with the failing parts' reasons joined (at most 300 chars). Model-graded specs are left out of
    the mean and returned in `Scored.model_graded`; with nothing else, reward 0.0, status "ok", reason
    "model-graded only". A reply that is not a str, empty, huge or binary scores 0 with a reason.

    Args:
      specs: anything `parse_verifier` takes.
      reply: the model's reply.
      row: the task-file row (checked with `check_row`).
      timeout_s: the bound on one symbolic comparison (math); a regex runs at most min(timeout_s, REGEX_TIMEOUT_S).
      code_runner: ``(program, seconds) -> SandboxResult`` for code_tests (e.g. `envs.sandbox.run` with cpu_s =
        wall_s = seconds); without one, code_tests scores 0 with status "infra_error".

    Raises:
      ValueError: bad specs, a non-positive `timeout_s`, or a row `check_row` refuses.
    """
    specs = parse_verifier(specs)
    if not row_verifiers.finite(timeout_s) or not timeout_s > 0:
        raise ValueError(f"score: timeout_s must be a positive number of seconds, got {timeout_s!r}")
    problem = check_row(specs, row)
    if problem:
        raise ValueError(f"score: the row does not fit its verifiers: {problem}")
    model = tuple(s for s in specs if VERIFIERS[s.name].model_graded)
    computed = [s for s in specs if not VERIFIERS[s.name].model_graded]
    if not computed:
        return Scored(answers.Verdict(0.0, "ok", reason="model-graded only"), {}, model)
    keys = _part_keys(computed)
    verdicts = [_run(s, reply, row, timeout_s, code_runner) for s in computed]
    parts = {k: v.reward for k, v in zip(keys, verdicts)}
    if len(computed) == 1:
        return Scored(verdicts[0], parts, model)
    failing = [(k, v) for k, v in zip(keys, verdicts) if v.reward < 1.0]
    reward = 1.0 if not failing else sum(s.weight * v.reward for s, v in zip(computed, verdicts)) / sum(
        s.weight for s in computed)
    reason = "; ".join(f"{k}: {v.reason or v.status}" for k, v in failing)[:row_verifiers.MAX_REASON_CHARS]
    first = verdicts[0]
    verdict = answers.Verdict(reward, failing[0][1].status if failing else "ok", first.extracted, first.gold,
                              first.method, reason)
    return Scored(verdict, parts, model)


def _passes(spec: VerifierSpec, reply: str, row: Mapping) -> bool:
    if spec.name == "code_tests":  # cannot run here: only its own reference (the row's solution) passes
        return reply == _ref_code(row, spec.args)
    return _run(spec, reply, row, answers.DEFAULT_TIMEOUT_S, None).reward == 1.0


def reference_reply(specs, row: Mapping) -> str | None:
    """A reply that should score 1 with these verifiers (the golden check of a row), or None when none can be built.

    Each computed verifier proposes one (``<answer>gold</answer>``, ``#### gold``, a ```json block, the row's
    "solution" in a ```python block, the row's "example" or "answer" for regex); the first that every computed
    verifier accepts is returned (code_tests is not run here: only its own proposal counts). None when all specs
    are model-graded or no proposal passes. Raises ValueError on bad specs or a row `check_row` refuses."""
    specs = parse_verifier(specs)
    problem = check_row(specs, row)
    if problem:
        raise ValueError(f"reference_reply: the row does not fit its verifiers: {problem}")
    computed = [s for s in specs if not VERIFIERS[s.name].model_graded]
    for spec in computed:
        candidate = VERIFIERS[spec.name].reference(row, spec.args)
        if candidate is not None and all(_passes(s, candidate, row) for s in computed):
            return candidate
    return None
