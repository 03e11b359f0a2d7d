"""User mistakes, one line each: the error types, the checks every config value goes through,
the boundary that prints a mistake as one `error:` line with exit code 2 (`user_errors`), and the
entry scripts' `hydra_main`, which brings Hydra's own errors to that boundary.

Every error the project raises for bad input derives from UserError (ConfigError and DataError
and CheckpointError, all here), so one handler covers them all, and nothing else:
a ValueError from a bug keeps its traceback.

`check(key, value, ok, rule)` names the key the user typed and what it accepts, `error: <key>
must be <rule>, got <value>`. Every config object uses it (GPTConfig, the run config, sampling
parameters, the sample and evaluate keys), so a bad value reads the same wherever it was typed.

Hydra reports a typo'd key, a malformed override or an unknown config group option in several
lines and exits 1. `hydra_main` lets Hydra raise instead (HYDRA_FULL_ERROR, set around Hydra's
own work only: the task and the processes it starts see the user's environment) and prints each
as one `error:` line, exit code 2. Errors raised by the task itself pass through untouched: the task
handles its users' mistakes with `user_errors()`, and anything else is a bug whose traceback must
show. Hydra is imported inside: model/ and data/ use the checks without loading it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn, TypeVar

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"  # what every entry point composes
T = TypeVar("T")


class UserError(ValueError):
    """A user's mistake, said in one line: what was wrong and how to fix it. `user_errors` prints
    these; anything else is a bug (a path the user named becomes one: `user_path`)."""


class ConfigError(UserError):
    """A configuration value that cannot work; the message names the key and what it accepts
    (`key`, where the caller needs it apart: an API error's param)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class DataError(UserError):
    """A user mistake in the data (bad name, missing file, too little data), said in one line:
    what was wrong and how to fix it."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or corrupt; the message says which file and why."""


def exit_user_error(message: str) -> NoReturn:
    """The one way out for a user mistake: `error: <message>` as one line on stderr, exit 2."""
    print(f"error: {' '.join(message.splitlines())}", file=sys.stderr)
    sys.exit(2)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A user mistake inside the block, a UserError (bad config, data, checkpoint or path),
    exits through `exit_user_error`, without a traceback. Any other exception is a bug, and its
    traceback shows: an OSError too, unless it was raised opening a path the user named."""
    try:
        yield
    except UserError as e:
        exit_user_error(str(e) or type(e).__name__)


# missing; not theirs; a directory where a file belongs, or the reverse; a file in mkdir's way
PATH_ERRORS = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
)


@contextlib.contextmanager
def user_path(key: str) -> Iterator[None]:
    """Opening (or making) a path the user named under `key` inside the block: missing, not
    theirs, or a directory where a file belongs (or the reverse), it is a UserError naming the
    key, e.g. `data.train_files: No such file or directory: 'corpus.txt'`."""
    try:
        yield
    except PATH_ERRORS as e:
        raise UserError(f"{key}: {e.strerror}: {str(e.filename)!r}") from None


# ----- checks: one message shape for every config value -------------------------------------------


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


# ----- settings: each config key declared once ----------------------------------------------------

# A settings dataclass declares each key once: its type (a `Literal[...]` lists its choices; bool;
# `| None` allows null), its check beyond the type, and whether a resumed run may change it
# (`setting`); its default is read from configs/ (`defaults_from`); `validate` applies it all.
# A field declared without `setting` fails at the first object built, so a new key cannot miss
# its check or its resume decision.


def setting(rule: Callable[[str, Any], Any] | None = None, *, resumable: bool, **kw: Any) -> Any:
    """A dataclass field: `rule(key, value)` returns the value checked (and normalised), or
    raises ConfigError; `resumable`: a resumed run may change it. kw: dataclasses.field's."""
    return dataclasses.field(metadata={"rule": rule, "resumable": resumable}, **kw)


def yaml_config(name: str) -> dict[str, Any]:
    """configs/<name>'s values, as written (no Hydra composition)."""
    import yaml

    return yaml.safe_load((CONFIG_DIR / name).read_text())


def defaults_from(values: dict[str, Any], **kw: Any) -> Callable[[type], type]:
    """Make a dataclass (kw: dataclasses.dataclass's) whose fields default to their entries in
    `values`, a section of a YAML file of configs/ (lists as tuples, so that no default is
    shared and mutable)."""

    def decorate(cls: type) -> type:
        for name in cls.__annotations__.keys() & values.keys():
            value = tuple(values[name]) if isinstance(values[name], list) else values[name]
            declared = cls.__dict__.get(name)
            if isinstance(declared, dataclasses.Field):
                declared.default = value
            else:
                setattr(cls, name, value)
        return dataclasses.dataclass(cls, **kw)

    return decorate


def validate(settings: Any, prefix: str = "") -> None:
    """Check every field of a `setting`-declared dataclass, in place; `prefix` ("train.")
    names the section in the error."""
    hints = typing.get_type_hints(type(settings))
    for f in dataclasses.fields(settings):
        key, value, kind = prefix + f.name, getattr(settings, f.name), hints[f.name]
        if "resumable" not in f.metadata:
            raise TypeError(f"{key} is declared without setting(...): give its check and resume")
        if value is None and type(None) in typing.get_args(kind):
            continue
        if typing.get_origin(kind) is typing.Literal:
            choice(key, value, typing.get_args(kind))
        elif kind is bool:
            boolean(key, value)
        if f.metadata["rule"] is not None:
            setattr(settings, f.name, f.metadata["rule"](key, value))


# ----- hydra_main: Hydra's errors at the same boundary --------------------------------------------


def hydra_main(config_name: str) -> Callable[[Callable[[Any], Any]], Callable[[], None]]:
    """`@hydra.main(config_path="configs", config_name=...)` for the scripts in the repository
    root; `-m`, `--cfg`, `--help` and every other Hydra flag work as with hydra.main."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    def decorate(task: Callable[[Any], Any]) -> Callable[[], None]:
        raised_by_task: list[BaseException] = []
        users = os.environ.get("HYDRA_FULL_ERROR")

        @hydra.main(config_path="configs", config_name=config_name, version_base=None)
        @functools.wraps(task)  # Hydra unwraps to `task`: configs/ next to its script
        def run(cfg: Any) -> Any:
            try:
                with _environment("HYDRA_FULL_ERROR", users):  # the task's and its children's
                    return task(cfg)
            except Exception as e:
                raised_by_task.append(e)
                raise

        @functools.wraps(task)
        def main() -> None:
            try:  # Hydra re-raises its errors instead of printing them (its documented switch)
                with _environment("HYDRA_FULL_ERROR", "1"):
                    run()
            except (HydraException, OmegaConfBaseException, ValueError) as e:
                if e in raised_by_task:  # the task's own: a bug, its traceback shows
                    raise
                exit_user_error(describe(e))
            except KeyboardInterrupt:  # Ctrl-C before the task's own handling of it
                print("interrupted", file=sys.stderr)
                sys.exit(130)

        return main

    return decorate


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """The environment variable `name` set to `value` (None: unset) inside the block only."""
    before = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if before is not None:
            os.environ[name] = before


def _group_choice_error() -> str | None:
    """The command line's group choice that YAML reads as no name (model=nan is a float), as
    the error of a name not there."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for arg in sys.argv[1:]:
        if "=" not in arg or arg.startswith("-"):
            continue
        (o,) = OverridesParser.create().parse_overrides([arg])
        group = o.key_or_group.lstrip("+~")
        if (CONFIG_DIR / group).is_dir() and not isinstance(o.value(), (str, list)):
            choices = ", ".join(sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml")))
            value = arg.split("=", 1)[1]
            return f"{group}={value} is not in configs/{group}/; choose one of: {choices}"
    return None


def describe(e: Exception) -> str:
    """One line for an error Hydra or OmegaConf raised while composing the config."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    if isinstance(e, MissingConfigException) and e.options is not None and e.missing_cfg_file:
        missing = PurePosixPath(e.missing_cfg_file)
        group, choices = missing.parent, ", ".join(sorted(e.options))
        return f"{group}={missing.name} is not in configs/{group}/; choose one of: {choices}"
    if isinstance(e, OverrideParseException):
        reason = e.message.splitlines()[0]
        return (
            f"cannot parse the override {e.override!r} ({reason}); write key=value, quoting "
            "lists and strings for the shell: 'data.train_files=[a.txt,b.txt]'"
        )
    cause = e.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:  # unknown key
        key = cause.full_key
        known = getattr(cause.parent_node, "keys", lambda: [])()
        prefix = key.rpartition(".")[0]
        names = [f"{prefix}.{k}" if prefix else str(k) for k in sorted(known) if k != "hydra"]
        return f"unknown config key {key}; known keys: {', '.join(names)}"
    if str(e).startswith("Config group override must be a string"):  # model=nan, model=1
        return _group_choice_error() or str(e)
    if str(e).startswith("Could not override '"):  # a key or group this script does not have
        key, script = str(e).split("'")[1], PurePosixPath(sys.argv[0]).name
        return f"unknown config key {key}; `python {script} --help` lists the keys"
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
