"""Tests for envs/tasks/repo_fix/tools.py (tool-call parsing) and patch.py (unified diffs): no sandbox runs."""
import json

import pytest

from envs.tasks.repo_fix import patch, tools
from envs.tasks.repo_fix.tools import ToolCall, parse_tool_calls

READ = ToolCall("read_file", {"path": "toolbox/core.py"})
TRICKY = 'x = "</tool_call>"\ny = "<tool_call>{}</tool_call>"\n'  # tags inside an argument's text

# (reply, expected calls, expected number of errors): both formats, well-formed, malformed, nested, truncated.
PARSE_TABLE = [
    # --- <tool_call> tags, well-formed
    ('<tool_call>{"name": "read_file", "arguments": {"path": "toolbox/core.py"}}</tool_call>', [READ], 0),
    ('Let me look.\n<tool_call>\n  {"name": "read_file",\n "arguments": {"path": "toolbox/core.py"}}\n</tool_call>\n',
     [READ], 0),
    ('<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"toolbox/core.py\\"}"}</tool_call>', [READ], 0),
    ('<tool_call>{"name": "read_file", "parameters": {"path": "toolbox/core.py"}}</tool_call>', [READ], 0),
    ('<tool_call>{"name": "submit"}</tool_call>', [ToolCall("submit", {})], 0),
    ('<tool_call>{"name": "list_files", "arguments": {}}</tool_call><tool_call>{"name": "submit", "arguments": {}}'
     '</tool_call>', [ToolCall("list_files", {}), ToolCall("submit", {})], 0),
    ('<tool_call>{"name": "run", "arguments": {"command": "ls", "timeout_s": 5, "extra": 1}}</tool_call>',
     [ToolCall("run", {"command": "ls", "timeout_s": 5})], 0),
    # nested: tags inside a string argument are text; a complete call missing only its closing tag at the end
    (tools.format_call("write_file", path="a.py", content=TRICKY),
     [ToolCall("write_file", {"path": "a.py", "content": TRICKY})], 0),
    ('<tool_call>{"name": "list_files", "arguments": {}}', [ToolCall("list_files", {})], 0),
    # Qwen2.5 / Qwen3 output as their templates write it (newlines inside the tags), nested JSON objects
    ('<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>', [ToolCall("submit", {})], 0),
    ('<tool_call>{"name": "run", "arguments": {"command": "ls", "env": {"A": {"B": [1, {"C": 2}]}}}}</tool_call>',
     [ToolCall("run", {"command": "ls"})], 0),
    ('<tool_call>{"name": "write_file", "arguments": {"path": "a.py", "content": "d = {1: {2: [3]}}"}}</tool_call>',
     [ToolCall("write_file", {"path": "a.py", "content": "d = {1: {2: [3]}}"})], 0),
    # --- <tool_call> tags, malformed
    ('<tool_call>\n{"name": "submit"', [], 1),  # truncated after the name
    ('<tool_call>{"name": "write_file", "arguments": {"path": "a.py", "content": "abc', [], 1),  # inside a string
    ('<tool_call>{"name": "run", "arguments": {"command": "ls", "env": {"A": {"B": 1}}</tool_call>', [], 1),
    ("<tool_call><tool_call>{\"name\": \"submit\"}</tool_call></tool_call>", [], 1),  # nested tags
    ('<tool_call>{"name": "read_file", "argu', [], 1),  # truncated JSON
    ("<tool_call>{'name': 'submit'}</tool_call>", [], 1),  # not JSON
    ('<tool_call>["submit"]</tool_call>', [], 1),
    ('<tool_call>{"arguments": {}}</tool_call>', [], 1),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', [], 1),
    ('<tool_call>{"name": "read_file", "arguments": {}}</tool_call>', [], 1),
    ('<tool_call>{"name": "read_file", "arguments": {"path": 3}}</tool_call>', [], 1),
    ('<tool_call>{"name": "run", "arguments": {"command": "ls", "timeout_s": true}}</tool_call>', [], 1),
    ('<tool_call>{"name": "read_file", "arguments": "not json"}</tool_call>', [], 1),
    ('<tool_call>{"name": "submit"} trailing</tool_call>', [], 1),
    ('<tool_call>{"name": "submit", "arguments": {}}</tool_call> then <tool_call>{"oops"</tool_call>',
     [ToolCall("submit", {})], 1),
    # --- fenced fallback (no tag in the reply)
    ('```json\n{"name": "read_file", "arguments": {"path": "toolbox/core.py"}}\n```', [READ], 0),
    ('```tool_call\n{"name": "submit", "arguments": {}}\n```', [ToolCall("submit", {})], 0),
    ('```\n{"name": "submit"}\n```', [ToolCall("submit", {})], 0),
    ('```json\n{"name": "write_file", "arguments": {"path": "a.py", "content": "```inner```"}}\n```',
     [ToolCall("write_file", {"path": "a.py", "content": "```inner```"})], 0),
    ('```json\n{"name": "read_file", "arguments": {"path": "toolbox/core.py"}', [], 1),  # truncated
    ('```json\n{"name": "submit",}\n```', [], 1),
    ('```json\n{"name": "write_file", "arguments": {"path": "a.py", "content": "d = {1: {2: [3]}}"}}\n```',
     [ToolCall("write_file", {"path": "a.py", "content": "d = {1: {2: [3]}}"})], 0),  # nested braces in a string
    ('```json\n{"name": "run", "arguments": {"command": "ls", "env": {"A": {"B": 1}}}}\n```',
     [ToolCall("run", {"command": "ls"})], 0),  # nested objects
    ('```json\n{"name": "write_file", "arguments": {"path": "a.py", "content": "abc', [], 1),  # truncated in a string
    ('```json\n{"name": "run", "arguments": {"command": "ls", "env": {"A": 1}}\n```', [], 1),  # unbalanced
    ('```json\n{"name": "nope"}\n```', [], 1),
    ('```python\n{"name": "submit"}\n```', [], 0),  # a python block is code, not a call
    ('```json\n{"answer": 3}\n```', [], 0),
    ("I think the bug is on line 3.", [], 0),
    ("", [], 0),
]


@pytest.mark.parametrize("reply,calls,n_errors", PARSE_TABLE)
def test_tool_call_parsing_table(reply, calls, n_errors):
    got_calls, errors = parse_tool_calls(reply)
    assert got_calls == calls
    assert len(errors) == n_errors, errors
    assert all(isinstance(e, str) and e for e in errors)


def test_tags_win_over_fences_and_errors_name_the_problem():
    reply = '```json\n{"name": "submit"}\n```\n<tool_call>{"name": "list_files"}</tool_call>'
    assert parse_tool_calls(reply) == ([ToolCall("list_files", {})], [])
    _, errors = parse_tool_calls('<tool_call>{"name": "frobnicate"}</tool_call>')
    assert "unknown tool 'frobnicate'" in errors[0] and "read_file" in errors[0]
    _, errors = parse_tool_calls('<tool_call>{"name": "write_file", "arguments": {"path": "a"}}</tool_call>')
    assert errors == ["write_file: missing argument(s) content"]
    with pytest.raises(TypeError, match="must be a str"):
        parse_tool_calls(None)


def test_schema_lists_every_tool_and_round_trips_through_the_parser():
    names = [t["function"]["name"] for t in tools.TOOLS]
    assert names == ["list_files", "read_file", "write_file", "apply_patch", "run", "submit"]
    prompt = tools.tools_prompt()
    assert all(f'"name": "{n}"' in prompt for n in names) and "<tool_call>" in prompt
    for line in prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines():
        assert json.loads(line)["type"] == "function"
    call = tools.format_call("run", command="python tests/run_tests.py")
    assert parse_tool_calls(call) == ([ToolCall("run", {"command": "python tests/run_tests.py"})], [])


OLD = {"pkg/a.py": "def f(x):\n    if x > 1:\n        return x - 1\n    return 0\n", "pkg/b.py": "B = 1\n",
       "gone.txt": "bye\n"}
NEW = {"pkg/a.py": "def f(x):\n    if x >= 1:\n        return x - 1\n    return 0\n", "pkg/b.py": "B = 2\n",
       "new.txt": "hi\n"}


def test_make_diff_then_apply_round_trips_updates_creations_and_deletions():
    diff = patch.make_diff(OLD, NEW)
    assert "--- a/pkg/a.py" in diff and "+++ /dev/null" in diff and "--- /dev/null" in diff
    changes = patch.apply(diff, OLD.get)
    result = {**OLD, **changes}
    assert {p: t for p, t in result.items() if t is not None} == NEW


def test_apply_is_lenient_about_line_numbers_counts_and_git_headers():
    diff = ("diff --git a/pkg/a.py b/pkg/a.py\nindex 123..456 100644\n--- a/pkg/a.py\n+++ b/pkg/a.py\n"
            "@@ -40,9 +40,9 @@ def f(x):\n def f(x):\n-    if x > 1:\n+    if x >= 1:\n         return x - 1\n")
    assert patch.apply(diff, OLD.get) == {"pkg/a.py": NEW["pkg/a.py"]}
    no_prefix = "--- pkg/b.py\n+++ pkg/b.py\n@@ -1 +1 @@\n-B = 1\n+B = 2\n"
    assert patch.apply(no_prefix, OLD.get) == {"pkg/b.py": "B = 2\n"}


@pytest.mark.parametrize("diff,message", [
    ("not a diff at all", "no file patch found"),
    ("@@ -1 +1 @@\n-B = 1\n+B = 2\n", "before any"),
    ("--- a/pkg/b.py\n+++ b/pkg/b.py\n@@ -1 +1 @@\n-B = 7\n+B = 2\n", "hunk 1 of pkg/b.py does not match"),
    ("--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n", "no such file"),
    ("--- /dev/null\n+++ b/pkg/b.py\n@@ -0,0 +1 @@\n+B = 3\n", "exists"),
])
def test_apply_refuses_what_does_not_match(diff, message):
    with pytest.raises(patch.PatchError, match=message):
        patch.apply(diff, OLD.get)


@pytest.mark.parametrize("reply", [
    "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>",
    "<tool_call>" + '{"a":' * 50_000,
    "```json\n" + '{"name": "run", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n```",
    '<tool_call>{"name": "run", "arguments": "' + "[" * 100_000 + "]" * 100_000 + '"}</tool_call>',
])
def test_json_nested_past_the_stack_is_a_parse_error_not_a_crash(reply):
    """RecursionError from json on a reply nested 50,000+ deep (it escaped step as an exception): one error."""
    calls, errors = parse_tool_calls(reply)
    assert calls == [] and len(errors) == 1 and ("nests too deeply" in errors[0] or "not a JSON object" in errors[0])
