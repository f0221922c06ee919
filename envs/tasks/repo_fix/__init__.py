"""RepoFix-v0: repository repair with tool calls, hidden tests and tamper-proof scoring (issue 27).

Modules: `problems` (HumanEval problems, visible/hidden case split), `mutate` (defect operators), `validate` (which
mutants the tests detect, run in the sandbox), `layout` (the repository's files), `tasks` (the task source),
`tools` (tool-call parsing, schema), `patch` (unified diffs), `session` (the episode's workspace and tools),
`scoring` (tamper-proof hidden-test scoring), `sandboxed` (the programs run inside the sandbox), `env` (the env).
"""
