"""Long-context tasks with exact answers, generated: a controlled length in tokens, the evidence at a controlled depth.

Families `documents` + `doc_questions`, `synthetic`, `codebase`; `lengths` places the pieces, `heuristics` holds the
gaming floors, `env` the environments (docs/long_context.md).
"""
