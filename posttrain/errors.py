"""Errors of bad input, each naming what is wrong, and the field checks config types run in `__post_init__`."""
from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

Rule = tuple[str, Callable[[Any], bool]]  # (what is allowed, in words; the check)
AT_LEAST_ONE: Rule = (">= 1", lambda v: v >= 1)
NONNEGATIVE: Rule = (">= 0", lambda v: v >= 0)
POSITIVE: Rule = ("> 0", lambda v: v > 0)


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the dotted key path."""


class DataError(ValueError):
    """A data file or record the config names is missing, undecodable or malformed, or leaves nothing to train on.

    The message names the file and line (`path:line`) or the record (`train_examples[i]`)."""


class FieldError(ConfigError):
    """One field of a config type is out of range or not one of its choices.

    The loader prefixes the section's path, so the message reads `rl.group_size=1 is out of range: ...`."""

    def __init__(self, field: str, value: Any, problem: str):
        self.field, self.value, self.problem = field, value, problem
        super().__init__(f"{field}={value!r}{problem}")


def check_fields(obj, ranges: Mapping[str, Rule] = {}, choices: Mapping[str, Collection] = {}) -> None:
    """Checks `obj`'s fields against their allowed choices, then their ranges, in the order given.

    Raises:
        FieldError: the first field whose value is not one of its choices or fails its range check."""
    for name, allowed in choices.items():
        value = getattr(obj, name)
        if value not in allowed:
            raise FieldError(name, value, f"; expected one of {tuple(allowed)}")
    for name, (allowed, ok) in ranges.items():
        value = getattr(obj, name)
        if not ok(value):
            raise FieldError(name, value, f" is out of range: must be {allowed}")
