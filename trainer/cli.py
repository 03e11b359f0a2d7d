"""train.py's Hydra glue: the validated run config (a resume's restored from the run it continues),
checked before Hydra creates the run directory, and the `.hydra/` files written once it starts.

The order of a `python train.py` run, so that a mistake leaves nothing behind and a failed or
refused attempt never overwrites a run's files:
1. Hydra composes the config (its own errors: base/errors.py);
2. `ValidateBeforeRunDir.on_run_start` validates it (`run_config`) before Hydra creates the run
   directory (configs/train.yaml sets hydra.output_subdir to null: Hydra writes nothing there);
3. train.py's main validates again (the same function), builds the Trainer (which prepares the
   data: a failure there removes the directories Hydra made for the run, `removed_if_failed`),
   and only then writes `.hydra/` (`write_run_files`).
"""

from __future__ import annotations

import contextlib
import copy
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from base.errors import ConfigError, exit_user_error, user_errors
from base.files import write_atomic
from checkpoints.store import RUNTIME_KEYS, read_config, resume_source, writable_error
from model import GPTConfig
from trainer.config import RunConfig

CONFIG_NAME = "train"
HYDRA_DIR = ".hydra"

# What a resumed run may change: how long it runs, how often it evaluates, logs and saves, where
# it runs and how it is tracked. Everything else (the model, the data and its order, the
# optimizer and its schedule) is the resumed run's.
RESUMABLE = (
    "train.max_steps",
    "train.max_seconds",
    "train.eval_interval",
    "train.eval_steps",
    "train.ckpt_interval",
    "train.keep_checkpoints",
    "train.log_interval",
    "train.on_nan",
    "train.sample_tokens",
    "train.skip_memory_check",
    "train.check_causality",
    "train.final_eval",
    "train.resume",
    "wandb",
    "parallel",
    "device",
    "dtype",
    "compile",
)
_UNSET = object()
# The topmost directory Hydra is about to create for this run (ValidateBeforeRunDir saw it
# missing): what `removed_if_failed` removes. Empty when the run dir existed, and in a sweep.
_made_for_run: list[Path] = []


def run_config(
    cfg: DictConfig, run_dir: str | Path, overrides: list[str]
) -> tuple[RunConfig, dict[str, Any]]:
    """The validated run config and its resolved plain tree (saved in .hydra/ and checkpoints).

    With train.resume, the config is the resumed run's (`saved_config`), plus this command's
    overrides of RESUMABLE keys; an override that changes anything else is a ConfigError naming
    the key. So `python train.py hydra.run.dir=<dir> train.resume=auto` continues a run as it
    was started, whatever overrides that took."""
    composed = _resolved(cfg)
    if composed["train"].get("init_from") is not None:  # the source fixes the rest of the model
        default_model = _resolved(compose(config_name=CONFIG_NAME))["model"]
        composed["model"] = requested_model(composed["model"], default_model, overrides)
    settings = _validated(composed)  # a bad value is named as typed, before any comparison
    resume = composed["train"].get("resume")
    saved = saved_config(resume, run_dir) if resume is not None else None
    if saved is None:
        return settings, composed
    keys = [o.key_or_group for o in OverridesParser.create().parse_overrides(overrides)]
    defaults = _resolved(compose(config_name=CONFIG_NAME))
    resolved = resumed_config(saved, composed, defaults, keys, resume)
    return _validated(resolved), resolved


def requested_model(
    model: dict[str, Any], default_model: dict[str, Any], overrides: list[str]
) -> dict[str, Any]:
    """The model keys a run sets itself: the run-time ones (checkpoints/store.py), those named
    in its command-line `overrides`, and those differing from `default_model`, the model section
    of the config composed without overrides (so set by an experiment or a model=<preset>
    choice). The default preset's other values are no request: train.init_from's source
    replaces them."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    named = {o.key_or_group[6:] for o in parsed if o.key_or_group.startswith("model.")}
    keep = {"block_size", *RUNTIME_KEYS, *named}
    return {k: v for k, v in model.items() if k in keep or default_model.get(k, _UNSET) != v}


def _validated(resolved: dict[str, Any]) -> RunConfig:
    """RunConfig checks every section; the model's fields are checked by GPTConfig (with the
    vocabulary size the tokenizer fills in later taken as valid)."""
    model = resolved.get("model") or {}
    GPTConfig.from_dict({**model, "vocab_size": model.get("vocab_size") or 1})
    return RunConfig.from_dict(resolved)


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    resolved.pop("hydra", None)
    return resolved


def saved_config(resume: str, run_dir: str | Path) -> dict[str, Any] | None:
    """The config of the run `train.resume` continues: its checkpoint's; for `auto` in a run
    stopped before its first checkpoint, its `.hydra/config.yaml`; None for a new run dir.
    The checkpoint is verified once, when the Trainer loads it."""
    source = resume_source(resume, run_dir)
    if source is not None:
        return read_config(source)["run"]
    saved = Path(run_dir) / HYDRA_DIR / "config.yaml"
    return OmegaConf.to_container(OmegaConf.load(saved), resolve=True) if saved.is_file() else None


def resumed_config(
    saved: dict[str, Any],
    composed: dict[str, Any],
    defaults: dict[str, Any],
    override_keys: list[str],
    resume: str,
) -> dict[str, Any]:
    """`saved` with what this command changes applied: the keys its overrides name
    (`override_keys`: `train.max_steps`, or a group such as `model`) and the keys they change
    from the `defaults` (a recipe such as `experiment=...` changes many). A change to a key
    outside RESUMABLE is a ConfigError naming it."""
    new, old, base = _flatten(composed), _flatten(saved), _flatten(defaults)
    touched = {p for p in new.keys() | base.keys() if new.get(p, _UNSET) != base.get(p, _UNSET)}
    touched |= {p for p in new.keys() | old.keys() for k in override_keys if _under(p, k)}
    result = copy.deepcopy(saved)
    for path in sorted(touched):
        value = new.get(path, _UNSET)
        if value == old.get(path, _UNSET):
            continue
        if not any(_under(path, k) for k in RESUMABLE):
            raise ConfigError(
                f"cannot resume with {path}={_show(value)}: the run resumed "
                f"(train.resume={resume}) has {path}={_show(old.get(path, _UNSET))}, and a "
                f"resumed run keeps its model, data and optimizer; drop the override (a resume "
                f"may change {', '.join(RESUMABLE)}) or start a new run"
            )
        _set(result, path.split("."), value)
    return result


def _under(path: str, key: str) -> bool:
    return path == key or path.startswith(key + ".")


def _show(value: Any) -> str:
    return "(unset)" if value is _UNSET else repr(value)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and empty dicts are values."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _set(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    if value is _UNSET:
        tree.pop(path[-1], None)
    else:
        tree[path[-1]] = value


def write_run_files(
    run_dir: str | Path,
    resolved: dict[str, Any],
    overrides: list[str],
    hydra_cfg: DictConfig,
    continues: bool,
) -> None:
    """What Hydra would write to `<run_dir>/.hydra/`: config.yaml (the run's resolved config),
    overrides.yaml and hydra.yaml, each replaced atomically. A run that `continues` this run
    dir (train.resume=auto) lists its earlier overrides first, so that the overrides, applied
    in order, still compose config.yaml."""
    out = Path(run_dir) / HYDRA_DIR
    out.mkdir(parents=True, exist_ok=True)
    earlier = out / "overrides.yaml"
    if continues and earlier.is_file():
        overrides = [*OmegaConf.to_container(OmegaConf.load(earlier)), *overrides]
    write_atomic(out / "config.yaml", OmegaConf.to_yaml(resolved))
    write_atomic(out / "overrides.yaml", OmegaConf.to_yaml(overrides))
    write_atomic(out / "hydra.yaml", OmegaConf.to_yaml({"hydra": hydra_cfg}))


class ValidateBeforeRunDir(Callback):
    """Hydra callback (configs/train.yaml): a bad config is one `error:` line and exit code 2
    before Hydra creates the run directory, so failed attempts leave nothing behind; and a
    run directory that cannot be written is one line too, long before the first checkpoint.
    (A sweep's runs are validated by train.py itself, in their own directories.)"""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
        with user_errors():
            run_config(task, config.hydra.run.dir, list(config.hydra.overrides.task))
        run_dir = Path(config.hydra.run.dir).absolute()
        _made_for_run[:] = [d for d in (run_dir, *run_dir.parents) if not d.exists()][-1:]
        _check_writable(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable(config.hydra.sweep.dir, "hydra.sweep.dir")


@contextlib.contextmanager
def removed_if_failed(owner: bool) -> Iterator[None]:
    """A run that fails before it starts (its data: a missing, empty or binary file; its memory)
    leaves no run directory: on an error in the block, the process holding the run's lock
    (`owner`) removes the directories Hydra made for it. A directory that existed before (a
    resume) is left as it was."""
    try:
        yield
    except BaseException:
        if owner and _made_for_run:
            shutil.rmtree(_made_for_run[0], ignore_errors=True)
        raise


def _check_writable(directory: str, key: str) -> None:
    if (reason := writable_error(directory)) is not None:
        exit_user_error(
            f"cannot write to the run directory {Path(directory).absolute()}: {reason}; "
            f"set {key} to a writable directory"
        )
