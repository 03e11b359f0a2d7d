"""The run configuration: typed, validated dataclasses, and how train.py gets the one it runs.

Hydra composes configs/train.yaml into a tree of plain values; `RunConfig.from_dict` checks every
field once, up front, so a bad override (`train.batch_size=abc`, `optim.lr=-1`) fails in one line
naming the key, before any data is prepared or memory is allocated.

The defaults are written once, in the YAML files Hydra composes (configs/train.yaml,
configs/optim/); the dataclasses read theirs from there (`defaults_from`), for code that builds
settings without Hydra. The end of this file: the command line's config (a resume's restored),
a Hydra callback that checks the run directory can be written before Hydra makes it (and a
sweep's every job's config before the first starts), and the `.hydra/` files written once the
run starts.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from hydra import compose
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # the sweeper -m runs
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from base.errors import (
    ConfigError,
    UserError,
    check,
    defaults_from,
    exit_user_error,
    non_negative_int,
    number,
    positive,
    positive_int,
    setting,
    validate,
    yaml_config,
)
from base.files import writable_error, write_atomic
from checkpoints.store import RUNTIME_KEYS, read_config, resume_source, source_tokenizer
from data.sources import absolute_paths
from hardware.device import device_name, dtype_name
from model import GPTConfig

TRAIN_YAML = yaml_config("train.yaml")
# optim=muon extends optim=adamw with its own keys; adamw's values win where both have one.
OPTIM_YAML = {**yaml_config("optim/muon.yaml"), **yaml_config("optim/adamw.yaml")}
DEFAULT_MAX_STEPS = 250  # train.max_steps: null without train.max_seconds (configs/train.yaml)


def _string(rule: str) -> Callable[[str, Any], str]:
    return lambda key, value: check(key, value, isinstance(value, str), rule)


def _list(example: str) -> Callable[[str, Any], list[str]]:
    def strings(key: str, value: Any) -> list[str]:
        check(key, value, isinstance(value, (list, tuple)), f"a list like {example}")
        return [str(v) for v in value]

    return strings


def _tasks(key: str, value: Any) -> list[str]:
    """Downstream task names, each found now (evals/tasks.py, loaded for runs that use it)."""
    names = _list("[hellaswag,arc_easy]")(key, value)
    if names:
        from evals.tasks import task_config

        for name in names:
            task_config(name)  # an unknown task fails here, before the run dir is made
    return names


def _betas(key: str, value: Any) -> tuple[float, float]:
    pair = isinstance(value, (list, tuple)) and len(value) == 2
    check(key, value, pair, "a pair like [0.9, 0.95]")
    return tuple(number(key, b, 0.0, 0.999999) for b in value)


def _at_least_0(key: str, value: Any) -> float:
    return number(key, value, low=0.0)


def _momentum(key: str, value: Any) -> float:
    return check(key, value, 0 <= number(key, value) < 1, "in [0, 1)")


# Each key: its type, its check, whether a resumed run may change it (RESUMABLE, below), and, in
# a comment, what it means; its default is the YAML file's. A resumed run may change how long it
# runs, how often it evaluates, logs and saves, where it runs and how it is tracked; everything
# else (the model, the data and its order, the optimizer and its schedule) is the resumed run's.


@defaults_from(TRAIN_YAML["train"])
class TrainSettings:
    # sequences per micro-batch (per rank when distributed)
    batch_size: int = setting(positive_int, resumable=False)
    grad_accum_steps: int = setting(positive_int, resumable=False)  # micro-batches per step
    # optimizer steps; None: as many as max_seconds allows, or DEFAULT_MAX_STEPS without it
    max_steps: int | None = setting(positive_int, resumable=True)
    # wall-clock budget for the training loop; the lr schedule then decays by time as well
    max_seconds: float | None = setting(positive, resumable=True)
    eval_interval: int = setting(non_negative_int, resumable=True)  # steps (0: at the end)
    eval_steps: int = setting(positive_int, resumable=True)  # batches per periodic evaluation
    ckpt_interval: int = setting(non_negative_int, resumable=True)  # steps (0: at the end)
    # step-<step> checkpoints kept besides last and best (0: none)
    keep_checkpoints: int = setting(non_negative_int, resumable=True)
    log_interval: int = setting(positive_int, resumable=True)  # steps between console lines
    resume: str | None = setting(_string("null, auto or a path"), resumable=True)
    # a GPT-2 name | a HF GPT-2 dir | a checkpoint or run dir
    init_from: str | None = setting(_string("null, a GPT-2 name or a path"), resumable=False)
    on_nan: Literal["stop", "skip"] = setting(resumable=True)  # on a non-finite loss or grad
    # tokens per sample generation logged at each evaluation (0: none)
    sample_tokens: int = setting(non_negative_int, resumable=True)
    # true: train even if the memory estimate exceeds the device
    skip_memory_check: bool = setting(resumable=True)
    check_causality: bool = setting(resumable=True)  # a shrunk copy first (trainer/preflight)
    # the evaluation at the end: the whole split | the eval_steps subset | none
    final_eval: Literal["whole", "periodic", "none"] = setting(resumable=True)
    eval_tasks: list[str] = setting(_tasks, resumable=False)  # configs/task/ names, or files
    eval_task_items: int | None = setting(positive_int, resumable=False)  # None: all items

    def __post_init__(self) -> None:
        # null is "not set": a time budget alone then ends the run, else the default steps
        if self.max_steps is None and self.max_seconds is None:
            self.max_steps = DEFAULT_MAX_STEPS
        validate(self, "train.")


@defaults_from(OPTIM_YAML)
class OptimSettings:
    """The optimizer and its learning-rate schedule (trainer/optim.py).

    name=adamw: AdamW on every parameter. name=muon: Muon on the 2-D weight matrices inside the
    transformer blocks, AdamW (lr, betas, eps, weight_decay) on everything else. The schedule
    scales every group's peak rate (lr, muon_lr) by the same factor. No key may change on a
    resume."""

    name: Literal["adamw", "muon"] = setting(resumable=False)
    lr: float = setting(positive, resumable=False)  # peak learning rate (muon: its AdamW part)
    # the embedding tables' own AdamW rate (their own group); None: lr
    embed_lr: float | None = setting(positive, resumable=False)
    min_lr: float = setting(_at_least_0, resumable=False)  # the schedule's floor, <= lr
    # on matrices and embeddings, never on biases and norms
    weight_decay: float = setting(_at_least_0, resumable=False)
    betas: tuple[float, float] = setting(_betas, resumable=False)
    eps: float = setting(_at_least_0, resumable=False)
    # linear warmup from lr / warmup_steps to lr
    warmup_steps: int = setting(non_negative_int, resumable=False)
    schedule: Literal["cosine", "wsd", "constant"] = setting(resumable=False)
    # wsd: the final fraction of steps (or max_seconds) that decays
    decay_fraction: float = setting(lambda k, v: number(k, v, 0.0, 1.0), resumable=False)
    grad_clip: float = setting(_at_least_0, resumable=False)  # max gradient norm (0: none)
    # name=muon only: the block matrices' optimizer (ignored by adamw)
    muon_lr: float = setting(positive, resumable=False)  # peak learning rate of the Muon group
    muon_momentum: float = setting(_momentum, resumable=False)
    muon_nesterov: bool = setting(resumable=False)
    # Newton-Schulz iterations that orthogonalize each update
    muon_ns_steps: int = setting(positive_int, resumable=False)
    # decoupled, as AdamW's: p -= lr * wd * p
    muon_weight_decay: float = setting(_at_least_0, resumable=False)

    def __post_init__(self) -> None:
        validate(self, "optim.")
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr ({self.min_lr}) must not exceed optim.lr ({self.lr})")


@defaults_from(TRAIN_YAML["wandb"])
class WandbSettings:
    # auto: online when logged in, else offline
    mode: Literal["auto", "online", "offline", "disabled"] = setting(resumable=True)
    project: str = setting(_string("a string"), resumable=True)
    name: str | None = setting(resumable=True)
    tags: list[str] = setting(_list("[a,b]"), resumable=True)
    entity: str | None = setting(resumable=True)

    def __post_init__(self) -> None:
        validate(self, "wandb.")


@defaults_from(TRAIN_YAML["parallel"])
class ParallelSettings:
    """Multi-process training under torchrun; a single process ignores this section."""

    # ddp: a full replica per rank | fsdp: weights, grads, optimizer sharded
    strategy: Literal["ddp", "fsdp"] = setting(resumable=True)
    # a collective waiting longer than this fails the job (a rank died)
    timeout_s: float = setting(positive, resumable=True)
    # whole: gathered to rank 0, which writes | sharded: each rank writes its own rows
    checkpoint: Literal["whole", "sharded"] = setting(resumable=True)

    def __post_init__(self) -> None:
        validate(self, "parallel.")


@defaults_from({key: TRAIN_YAML[key] for key in ("seed", "device", "dtype", "compile")})
class RunConfig:
    model: dict[str, Any] = setting(resumable=False)  # checked by GPTConfig (_validated)
    data: dict[str, Any] = setting(resumable=False)  # checked where it is prepared
    train: TrainSettings = setting(resumable=False, default_factory=TrainSettings)
    optim: OptimSettings = setting(resumable=False, default_factory=OptimSettings)
    wandb: WandbSettings = setting(resumable=True, default_factory=WandbSettings)
    parallel: ParallelSettings = setting(resumable=True, default_factory=ParallelSettings)
    seed: int = setting(non_negative_int, resumable=False)
    device: str = setting(device_name, resumable=True)  # auto | cpu | cuda | cuda:1 | mps
    dtype: str = setting(dtype_name, resumable=True)  # auto | float32 | bfloat16 | float16
    compile: bool = setting(resumable=True)

    def __post_init__(self) -> None:
        validate(self)
        if self.compile and self.model.get("attention") == "flash" and self.model.get("dropout"):
            raise ConfigError(
                "compile=true with model.attention=flash and model.dropout > 0 breaks the compiled "
                "graph at every tile (a random generator per tile); use model.attention=sdpa, "
                "model.dropout=0 or compile=false"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """Build from a resolved config tree; unknown keys are named in the error."""
        # `experiment` is the recipe's name; its values are already merged in.
        values = {k: v for k, v in values.items() if k != "experiment"}
        for f in dataclasses.fields(cls):
            if f.name in values and f.default_factory is not dataclasses.MISSING:  # a section
                values[f.name] = _build(f.default_factory, values[f.name] or {}, f"{f.name}.")
        return _build(cls, values, "")


def resumable_keys(kind: type = RunConfig, prefix: str = "") -> tuple[str, ...]:
    """The keys a resumed run may change, from their declarations: a whole section, or its
    resumable keys."""
    keys: list[str] = []
    for f in dataclasses.fields(kind):
        if f.metadata["resumable"]:
            keys.append(prefix + f.name)
        elif dataclasses.is_dataclass(f.default_factory):
            keys += resumable_keys(f.default_factory, f"{prefix}{f.name}.")
    return tuple(keys)


def _build(kind: type, values: dict[str, Any], prefix: str) -> Any:
    """kind(**values); `prefix` ("optim." or "") names the section in the error."""
    names = {f.name for f in dataclasses.fields(kind)}
    if unknown := sorted(set(values) - names):
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]}; known keys: "
            + ", ".join(f"{prefix}{n}" for n in sorted(names))
        )
    return kind(**values)


# ----- from the command line: the config a run runs, checked before its run dir exists ------------

# train.py's Hydra glue: the validated run config (a resume's restored from the run it continues),
# checked before Hydra creates the run directory, and the `.hydra/` files written once it starts.
#
# The order of a `python train.py` run, so that a mistake leaves nothing behind and a failed or
# refused attempt never overwrites a run's files:
# 1. Hydra composes the config (its own errors: base/errors.py);
# 2. `RunDirGuard.on_run_start` checks the run directory can be written and notes the directories
#    Hydra is about to make (configs/train.yaml sets hydra.output_subdir to null: Hydra writes
#    nothing there); in a sweep, `on_multirun_start` validates every job's config first;
# 3. train.py's main validates the config (`run_config`), builds the Trainer (which prepares the
#    data: a failure there removes the directories Hydra made for the run, `removed_if_failed`),
#    and only then writes `.hydra/` (`write_run_files`).

CONFIG_NAME = "train"
HYDRA_DIR = ".hydra"

RESUMABLE = resumable_keys()  # what a resumed run may change (the declarations above)
_UNSET = object()
# The topmost directory Hydra is about to create for this run (RunDirGuard saw it
# missing): what `removed_if_failed` removes. Empty when the run dir existed, and in a sweep
# (whose jobs' configs are validated before the first starts).
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
    composed["data"] = absolute_paths(composed["data"])  # the saved config works from anywhere
    settings = _validated(composed)  # a bad value is named as typed, before any comparison
    resume, source = composed["train"].get("resume"), composed["train"].get("init_from")
    resumed = resume_source(resume, run_dir)  # the checkpoint train.resume names, if any
    refuse_replacing_a_run(run_dir, resume, resumed)
    saved = saved_config(resumed, run_dir) if resume is not None else None
    if saved is None:
        if source is not None:  # the source fixes the architecture and the tokenizer
            default_model = _resolved(compose(config_name=CONFIG_NAME))["model"]
            composed["model"] = requested_model(composed["model"], default_model, overrides)
            composed["data"] = source_data(composed["data"], source, overrides)
            settings = dataclasses.replace(settings, model=composed["model"], data=composed["data"])
        return settings, composed
    keys = [o.key_or_group for o in OverridesParser.create().parse_overrides(overrides)]
    defaults = _resolved(compose(config_name=CONFIG_NAME))
    resolved = resumed_config(saved, composed, defaults, keys, resume)
    return _validated(resolved), resolved


def refuse_replacing_a_run(run_dir: str | Path, resume: str | None, resumed: Path | None) -> None:
    """A run dir's checkpoints are replaced only by the run they belong to: a new run there
    (train.init_from too), or a resume of another run's checkpoint (`resumed`, the one
    `train.resume` names), would write its own `last`, `best` and .hydra/ config over them, so
    it is refused. train.resume=auto continues the run, and a resume from one of its own
    checkpoints rolls it back."""
    checkpoints = Path(run_dir) / "checkpoints"
    held = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else []
    if not held or resume == "auto":
        return
    if resumed is not None and resumed.resolve().is_relative_to(Path(run_dir).resolve()):
        return
    raise ConfigError(
        f"the run directory {Path(run_dir).absolute()} already holds a run's checkpoints "
        f"({', '.join(held)}), which this run would replace; continue it with "
        "train.resume=auto, or give this run a directory of its own (hydra.run.dir; a "
        "sweep's: hydra.sweep.dir)"
    )


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
    keep = {*RUNTIME_KEYS, *named}
    return {k: v for k, v in model.items() if k in keep or default_model.get(k, _UNSET) != v}


def source_data(data: dict[str, Any], source: str, overrides: list[str]) -> dict[str, Any]:
    """The data section tokenized as train.init_from's own text was (its tokenizer, a trained
    one read from its checkpoint: checkpoints/store.py), unless this command names
    data.tokenizer_dir or another data.tokenizer (which `pretrained_model` then refuses)."""
    named = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(overrides)}
    theirs = source_tokenizer(source)
    mine = named.get("data.tokenizer", theirs["tokenizer"])
    if "data.tokenizer_dir" in named or mine != theirs["tokenizer"]:
        return data
    return {**data, **theirs}


def _validated(resolved: dict[str, Any]) -> RunConfig:
    """RunConfig checks every section; the model's fields are checked by GPTConfig (with the
    vocabulary size the tokenizer fills in later taken as valid), or with train.init_from by
    `pretrained_model`, over the source's (the model section holds only what the run asks)."""
    model = resolved.get("model") or {}
    if not (resolved.get("train") or {}).get("init_from"):
        GPTConfig.from_dict({**model, "vocab_size": model.get("vocab_size") or 1})
    return RunConfig.from_dict(resolved)


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    """The plain tree; Hydra keeps its own `hydra` node out of a task's and compose's config."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def saved_config(resumed: Path | None, run_dir: str | Path) -> dict[str, Any] | None:
    """The config of the run `train.resume` continues: its checkpoint's (`resumed`); for `auto`
    in a run stopped before its first checkpoint (no `resumed`), its `.hydra/config.yaml`; None
    for a new run dir. The checkpoint is verified once, when the Trainer loads it."""
    if resumed is not None:
        return read_config(resumed)["run"]
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
            group = next((k for k in override_keys if k != path and _under(path, k)), None)
            via = f" (set by the {group}=... override)" if group else ""
            raise ConfigError(
                f"cannot resume with {path}={_show(value)}{via}: the run resumed "
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


class RunDirGuard(Callback):
    """Hydra callback (configs/train.yaml), before Hydra creates the run directory: one that
    cannot be written is one `error:` line, long before the first checkpoint, and the
    directories Hydra is about to make are noted, for `removed_if_failed` to remove should the
    run fail before it starts (train.py validates its config there). A sweep (`-m`) validates
    every job's config before the first starts, naming the job."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = Path(config.hydra.run.dir).absolute()
        _made_for_run[:] = [d for d in (run_dir, *run_dir.parents) if not d.exists()][-1:]
        _check_writable(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
        sweep_dir = Path(config.hydra.sweep.dir)
        for n, job in enumerate(BasicSweeper.split_arguments(parsed, None)[0]):  # as it runs them
            try:
                run_config(compose(config_name=CONFIG_NAME, overrides=job), sweep_dir / str(n), job)
            except UserError as e:  # what user_errors catches
                exit_user_error(f"sweep job {n} ({' '.join(job)}): {e}")
        _check_writable(config.hydra.sweep.dir, "hydra.sweep.dir")


@contextlib.contextmanager
def removed_if_failed(owner: bool) -> Iterator[None]:
    """A run that fails before it starts (its config; its data: a missing, empty or binary
    file; its memory) leaves no run directory: on an error in the block, the process holding
    the run's lock (`owner`) removes the directories Hydra made for it. A directory that
    existed before (a resume) is left as it was."""
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
