"""RepoFix-v0: repository repair with tool calls, hidden tests and tamper-proof scoring (design: docs/repo_fix.md).

Modules: `problems` (HumanEval problems, visible/hidden case split), `mutate` (defect operators), `validate` (which
mutants the tests detect), `layout` (the repository's files), `tasks` (the task source), `tools` (tool calls),
`patch` (unified diffs), `session` (the episode's workspace and tools), `scoring` (tamper-proof hidden-test
scoring), `sandboxed` (the programs run in the sandbox), `env` (the env), `impossible` (the cheating-rate probe).
"""
