"""The one way a config value is checked: `check(key, value, ok, rule)` names the key the user
typed and what it accepts, `error: <key> must be <rule>, got <value>`, and returns the value.

Every config object uses these (GPTConfig, the run config, sampling parameters, the sample and
evaluate keys), so a bad value reads the same wherever it was typed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

from base.errors import ConfigError

T = TypeVar("T")


def check(key: str, value: T, ok: bool, rule: str) -> T:
    """`value` if ok, else ConfigError("<key> must be <rule>, got <value>")."""
    if not ok:
        raise ConfigError(f"{key} must be {rule}, got {value!r}")
    return value


def is_int(value: Any, minimum: int) -> bool:
    """An int (YAML's true and false are not) of at least `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_number(value: Any, low: float = -math.inf, high: float = math.inf) -> bool:
    """A finite int or float in [low, high] (YAML's true and false are not numbers)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return ok and low <= value <= high


def positive_int(key: str, value: Any) -> int:
    return check(key, value, is_int(value, 1), "a positive integer")


def non_negative_int(key: str, value: Any) -> int:
    return check(key, value, is_int(value, 0), "a non-negative integer")


def number(key: str, value: Any, low: float = -math.inf, high: float = math.inf) -> float:
    """A finite number, within [low, high]."""
    check(key, value, is_number(value), "a finite number")
    return float(check(key, value, low <= value <= high, f"in [{low}, {high}]"))


def positive(key: str, value: Any, rule: str = "positive") -> float:
    """A finite number above 0."""
    return check(key, value, number(key, value) > 0, rule)


def boolean(key: str, value: Any) -> bool:
    return check(key, value, isinstance(value, bool), "true or false")


def choice(key: str, value: Any, choices: Sequence[str]) -> str:
    """One of `choices`; the error lists them all."""
    return check(key, value, value in choices, f"one of {list(choices)}")
