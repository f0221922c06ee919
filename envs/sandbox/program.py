"""What a sandbox is asked to run, checked before anything starts (shared by `envs.sandbox.run` and `SandboxPool.run`).

`check_program`: the arguments' types; `unrunnable`: whether any process could take the program as given.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from envs.sandbox import files as sbx_files


def _python() -> str:
    from envs.sandbox import PYTHON  # the package's interpreter setting (set when it was imported)

    return PYTHON


def check_program(files_or_code, argv, stdin) -> tuple[Mapping[str, str | bytes], list[str]]:
    """`run`'s program arguments checked: (files to write, argv); TypeError/ValueError naming the offending value."""
    if isinstance(files_or_code, str):
        files, argv = {"main.py": files_or_code}, list(argv) if argv is not None else [_python(), "main.py"]
    elif isinstance(files_or_code, Mapping):
        if argv is None:
            raise ValueError("run(files, argv): argv is required when files_or_code is a mapping")
        files, argv = files_or_code, list(argv)
    else:
        raise TypeError(f"files_or_code must be str or a mapping, got {type(files_or_code).__name__}")
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of str, got {argv!r}")
    for relpath, content in files.items():
        sbx_files.split_relpath(relpath)
        if not isinstance(content, (str, bytes)):
            raise TypeError(f"sandbox file {relpath!r}: content must be str or bytes, got {type(content).__name__}")
    if stdin is not None and not isinstance(stdin, str):
        raise TypeError(f"stdin must be str or None, got {type(stdin).__name__}")
    return files, argv


MAX_ARGV_BYTES = 100_000  # under Linux's 128 KiB limit on one argument (MAX_ARG_STRLEN), with room for the launcher's


def unrunnable(files: Mapping[str, str | bytes], argv: Sequence[str], stdin: str | None) -> str | None:
    """Why no process can take the program as given; None when one can.

    A NUL byte in an argument, a lone surrogate in any text, or a command line over MAX_ARGV_BYTES: the program's
    fault, not the sandbox's, so `run` answers it with `refused`, never infra_error.
    """
    for where, text in [*((f"argument {i}", a) for i, a in enumerate(argv)), ("stdin", stdin or ""),
                        *((f"file {p}", c) for p, c in files.items() if isinstance(c, str))]:
        if where.startswith("argument") and "\x00" in text:
            return f"{where} contains a NUL byte"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{where} is not valid text: {e.reason} (character {e.start})"
    size = sum(len(a.encode()) + 1 for a in argv)
    if size > MAX_ARGV_BYTES:
        return f"the command line is {size} bytes, over the {MAX_ARGV_BYTES}-byte limit (write it to a file)"
    return None
