"""Tool calls of RepoFix-v0, parsed from the reply text, and the tool schema shown to the model.

Format (Hermes / Qwen2.5 style, as plain text, so templates without tool tokens work too)::

    <tool_call>{"name": "read_file", "arguments": {"path": "toolbox/core.py"}}</tool_call>

A call that cannot be read is an error string, never an exception; the env shows it to the model and counts it.
"""
from __future__ import annotations

import dataclasses
import json
import re

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS_PER_TURN = 8
_FENCE_RE = re.compile(r"```[ \t]*([\w-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.M | re.S)
_FENCE_TAGS = ("json", "tool_call", "tool", "")
_DECODER = json.JSONDecoder()


def _schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


_PATH = {"type": "string", "description": "a path relative to the repository root"}
TOOLS = [
    _schema("list_files", "List the repository's files (under `path`, default the root).",
            {"path": {**_PATH, "description": "a directory relative to the repository root (default: the root)"}}, []),
    _schema("read_file", "Show a file's text.", {"path": _PATH}, ["path"]),
    _schema("write_file", "Create or overwrite a file with `content`.",
            {"path": _PATH, "content": {"type": "string", "description": "the file's complete new text"}},
            ["path", "content"]),
    _schema("apply_patch", "Apply a unified diff (--- a/PATH, +++ b/PATH, @@ hunks) to the repository's files.",
            {"patch": {"type": "string", "description": "the unified diff"}}, ["patch"]),
    _schema("run", "Run a shell command in the repository root (bash; output and time are capped).",
            {"command": {"type": "string", "description": "e.g. python tests/run_tests.py"},
             "timeout_s": {"type": "number", "description": "seconds before the command is stopped (capped)"}},
            ["command"]),
    _schema("submit", "Finish: your changes are final and get tested. Call it once, when the fix is done.", {}, []),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
_TYPES = {"string": str, "number": (int, float)}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: a tool name from `TOOLS` and its (checked) arguments."""

    name: str
    arguments: dict


def check_call(obj) -> ToolCall | str:
    """A `ToolCall` from a decoded JSON value, or an error string saying what is wrong with it.

    ``arguments`` may be a JSON string holding the object, or absent for a tool without required arguments."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str):
        return 'a tool call needs a "name" string'
    if name not in SCHEMAS:
        return f"unknown tool {name[:40]!r}; tools: {', '.join(SCHEMAS)}"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return f'{name}: "arguments" is a string that is not a JSON object'
    if not isinstance(args, dict):
        return f'{name}: "arguments" must be an object, got {type(args).__name__}'
    schema = SCHEMAS[name]
    missing = [k for k in schema["required"] if k not in args]
    if missing:
        return f"{name}: missing argument(s) {', '.join(missing)}"
    for key, spec in schema["properties"].items():
        value = args.get(key)
        if key in args and (not isinstance(value, _TYPES[spec["type"]]) or isinstance(value, bool)):
            return f"{name}: argument {key!r} must be a {spec['type']}, got {type(value).__name__}"
    return ToolCall(name, {k: v for k, v in args.items() if k in schema["properties"]})


TOO_DEEP = "the tool call's JSON nests too deeply to parse"


def _tagged(text: str) -> tuple[list[ToolCall], list[str]]:
    calls, errors, pos = [], [], 0
    while (start := text.find(OPEN, pos)) != -1:
        at = start + len(OPEN)
        while at < len(text) and text[at].isspace():
            at += 1
        close = text.find(CLOSE, at)
        try:
            obj, end = _DECODER.raw_decode(text, at)
        except RecursionError:  # nesting deeper than the interpreter's stack: the model's reply, not an env fault
            errors.append(TOO_DEEP)
            pos = close + len(CLOSE) if close != -1 else len(text)
            continue
        except ValueError as exc:
            if close == -1:
                errors.append("truncated tool call: no complete JSON object and no closing </tool_call>")
                break
            errors.append(f"the tool call is not valid JSON ({exc.msg} at char {exc.pos - at})")
            pos = close + len(CLOSE)
            continue
        rest = text[end:].lstrip()
        if rest and not rest.startswith(CLOSE):
            errors.append("expected </tool_call> right after the JSON object")
            pos = close + len(CLOSE) if close != -1 and close > end else end
            continue
        result = check_call(obj)
        (calls if isinstance(result, ToolCall) else errors).append(result)
        pos = len(text) - len(rest) + len(CLOSE) if rest else len(text)
    return calls, errors


def _fenced(text: str) -> tuple[list[ToolCall], list[str]]:
    calls, errors = [], []
    for match in _FENCE_RE.finditer(text):
        tag, body = match.group(1).lower(), match.group(2).strip()
        if tag not in _FENCE_TAGS or not body.startswith("{"):
            continue
        try:
            obj = json.loads(body)
        except RecursionError:
            errors.append(TOO_DEEP)
            continue
        except ValueError as exc:
            if tag or '"name"' in body:
                closed = match.group(0).rstrip().endswith("```") and len(match.group(0).rstrip()) > 3
                errors.append(f"the fenced tool call is not valid JSON ({exc.msg})" if closed
                              else "truncated fenced tool call: no closing ```")
            continue
        if isinstance(obj, dict) and "name" in obj:
            result = check_call(obj)
            (calls if isinstance(result, ToolCall) else errors).append(result)
    return calls, errors


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """(calls, errors) of a reply: the ``<tool_call>`` calls, or the fenced-block calls when no tag is present.

    The JSON is read with `json.JSONDecoder.raw_decode` right after the tag, so a ``</tool_call>`` inside a string
    argument does not end the call. The fallback reads fenced blocks tagged ``json``, ``tool_call``, ``tool`` or
    untagged that hold an object with a ``"name"``. Raises TypeError on a non-str."""
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls: text must be a str, got {type(text).__name__}")
    return _tagged(text) if OPEN in text else _fenced(text)


def format_call(name: str, **arguments) -> str:
    """The text of a call to `name` with `arguments` (what a well-behaved model writes)."""
    return OPEN + json.dumps({"name": name, "arguments": arguments}) + CLOSE


def tools_prompt() -> str:
    """The tool instructions and JSON schema for the first observation."""
    schema = "\n".join(json.dumps(t) for t in TOOLS)
    return ("# Tools\n\nCall a tool by writing, in your reply:\n"
            '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
            "Several calls in one reply run in order; their results come back in the next message. "
            f"The tools (JSON schema):\n<tools>\n{schema}\n</tools>")
