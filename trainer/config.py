"""The run configuration as typed, validated dataclasses.

Hydra composes configs/train.yaml into a tree of plain values; `RunConfig.from_dict` checks every
field once, up front, so a bad override (`train.batch_size=abc`, `optim.lr=-1`) fails in one line
naming the key, before any data is prepared or memory is allocated.

The defaults are written once, in the YAML files Hydra composes (configs/train.yaml,
configs/optim/); the dataclasses read theirs from there (`defaults_from`), for code that builds
settings without Hydra.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from base.errors import (
    CONFIG_DIR,
    ConfigError,
    boolean,
    check,
    choice,
    non_negative_int,
    number,
    positive,
    positive_int,
)


def _yaml(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIG_DIR / name).read_text())


TRAIN_YAML = _yaml("train.yaml")
# optim=muon extends optim=adamw with its own keys; adamw's values win where both have one.
OPTIM_YAML = {**_yaml("optim/muon.yaml"), **_yaml("optim/adamw.yaml")}


def defaults_from(values: dict[str, Any]) -> Callable[[type], type]:
    """Make a dataclass whose fields default to their entries in `values` (lists as tuples,
    so that no default is shared and mutable)."""

    def decorate(cls: type) -> type:
        for name in cls.__annotations__.keys() & values.keys():
            value = values[name]
            setattr(cls, name, tuple(value) if isinstance(value, list) else value)
        return dataclass(cls)

    return decorate


DEFAULT_MAX_STEPS = 250  # train.max_steps: null without train.max_seconds (configs/train.yaml)


@defaults_from(TRAIN_YAML["train"])
class TrainSettings:
    batch_size: int  # sequences per micro-batch (per rank when distributed)
    grad_accum_steps: int  # micro-batches per optimizer step
    # optimizer steps; None: as many as max_seconds allows, or DEFAULT_MAX_STEPS without it
    max_steps: int | None
    # wall-clock budget for the training loop; the lr schedule then decays by time as well
    max_seconds: float | None
    eval_interval: int  # steps between evaluations (0: only at the end)
    eval_steps: int  # batches per periodic evaluation (a fixed subset of val)
    ckpt_interval: int  # steps between `last` checkpoints (0: only at the end)
    keep_checkpoints: int  # step-<step> checkpoints kept besides last and best (0: none)
    log_interval: int  # steps between console / wandb lines
    resume: str | None  # null | auto | a checkpoint or run directory
    init_from: str | None  # null | a GPT-2 name | a HF GPT-2 dir | a checkpoint or run dir
    on_nan: str  # stop | skip: what a non-finite loss or gradient does
    sample_tokens: int  # tokens per sample generation logged at each evaluation (0: none)
    skip_memory_check: bool  # true: train even if the memory estimate exceeds the device
    check_causality: bool  # check a shrunk copy of the model first (trainer/preflight.py)
    final_eval: str  # the evaluation at the end: whole | periodic (the eval_steps subset) | none
    eval_tasks: list[str]  # downstream tasks scored at each evaluation (configs/task/ names)
    eval_task_items: int | None  # the first N items of each task (None: all)

    def __post_init__(self) -> None:
        # null is "not set": a time budget alone then ends the run, else the default steps
        if self.max_steps is None and self.max_seconds is None:
            self.max_steps = DEFAULT_MAX_STEPS
        for name in ("batch_size", "grad_accum_steps", "eval_steps", "log_interval"):
            positive_int(f"train.{name}", getattr(self, name))
        if self.max_steps is not None:
            positive_int("train.max_steps", self.max_steps)
        for name in ("eval_interval", "ckpt_interval", "keep_checkpoints", "sample_tokens"):
            non_negative_int(f"train.{name}", getattr(self, name))
        if self.max_seconds is not None:
            positive("train.max_seconds", self.max_seconds, "positive or null")
        resume_ok = self.resume is None or isinstance(self.resume, str)
        check("train.resume", self.resume, resume_ok, "null, auto or a path")
        init_ok = self.init_from is None or isinstance(self.init_from, str)
        check("train.init_from", self.init_from, init_ok, "null, a GPT-2 name or a path")
        choice("train.on_nan", self.on_nan, ("stop", "skip"))
        choice("train.final_eval", self.final_eval, ("whole", "periodic", "none"))
        boolean("train.skip_memory_check", self.skip_memory_check)
        boolean("train.check_causality", self.check_causality)
        if self.eval_task_items is not None:
            positive_int("train.eval_task_items", self.eval_task_items)
        ok = isinstance(self.eval_tasks, (list, tuple))
        check("train.eval_tasks", self.eval_tasks, ok, "a list like [hellaswag,arc_easy]")
        self.eval_tasks = [str(name) for name in self.eval_tasks]
        if self.eval_tasks:
            from evals.tasks import task_config  # the tasks' module only for runs that use it

            for name in self.eval_tasks:
                task_config(name)  # an unknown task fails here, before the run dir is made


@defaults_from(OPTIM_YAML)
class OptimSettings:
    """The optimizer and its learning-rate schedule (trainer/optim.py, trainer/optim.py).

    name=adamw: AdamW on every parameter. name=muon: Muon on the 2-D weight matrices inside the
    transformer blocks, AdamW (lr, betas, eps, weight_decay) on everything else. The schedule
    scales every group's peak rate (lr, muon_lr) by the same factor."""

    name: str  # adamw | muon
    lr: float  # peak learning rate (under muon: of the AdamW part)
    embed_lr: float | None  # the embedding tables' own AdamW rate (their own group); None: lr
    min_lr: float  # the schedule's floor
    weight_decay: float  # on matrices and embeddings, never on biases and norms
    betas: tuple[float, float]
    eps: float
    warmup_steps: int  # linear warmup from lr / warmup_steps to lr
    schedule: str  # cosine | wsd | constant
    decay_fraction: float  # wsd: the final fraction of steps (or max_seconds) that decays
    grad_clip: float  # max global gradient norm (0: no clipping)
    # name=muon only: the block matrices' optimizer (ignored by adamw)
    muon_lr: float  # peak learning rate of the Muon group
    muon_momentum: float
    muon_nesterov: bool
    muon_ns_steps: int  # Newton-Schulz iterations that orthogonalize each update
    muon_weight_decay: float  # decoupled, as AdamW's: p -= lr * wd * p

    def __post_init__(self) -> None:
        choice("optim.name", self.name, ("adamw", "muon"))
        positive("optim.lr", self.lr)
        if self.embed_lr is not None:
            positive("optim.embed_lr", self.embed_lr, "positive or null")
        for name in ("min_lr", "weight_decay", "eps", "grad_clip", "muon_weight_decay"):
            number(f"optim.{name}", getattr(self, name), low=0.0)
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr ({self.min_lr}) must not exceed optim.lr ({self.lr})")
        pair = isinstance(self.betas, (list, tuple)) and len(self.betas) == 2
        check("optim.betas", self.betas, pair, "a pair like [0.9, 0.95]")
        self.betas = tuple(number("optim.betas", b, 0.0, 0.999999) for b in self.betas)
        non_negative_int("optim.warmup_steps", self.warmup_steps)
        choice("optim.schedule", self.schedule, ("cosine", "wsd", "constant"))
        number("optim.decay_fraction", self.decay_fraction, 0.0, 1.0)
        positive("optim.muon_lr", self.muon_lr)
        momentum = number("optim.muon_momentum", self.muon_momentum)
        check("optim.muon_momentum", momentum, 0 <= momentum < 1, "in [0, 1)")
        boolean("optim.muon_nesterov", self.muon_nesterov)
        positive_int("optim.muon_ns_steps", self.muon_ns_steps)


@defaults_from(TRAIN_YAML["wandb"])
class WandbSettings:
    mode: str  # auto: online when logged in, else offline | online | offline | disabled
    project: str
    name: str | None
    tags: list[str]
    entity: str | None

    def __post_init__(self) -> None:
        choice("wandb.mode", self.mode, ("auto", "online", "offline", "disabled"))
        check("wandb.tags", self.tags, isinstance(self.tags, (list, tuple)), "a list like [a,b]")
        self.tags = [str(t) for t in self.tags]


@defaults_from(TRAIN_YAML["parallel"])
class ParallelSettings:
    """Multi-process training under torchrun; a single process ignores this section."""

    strategy: str  # ddp: a full replica per rank | fsdp: weights, grads, optimizer sharded
    timeout_s: float  # a collective waiting longer than this fails the job (a rank died)

    def __post_init__(self) -> None:
        choice("parallel.strategy", self.strategy, ("ddp", "fsdp"))
        positive("parallel.timeout_s", self.timeout_s)


@defaults_from({key: TRAIN_YAML[key] for key in ("seed", "device", "dtype", "compile")})
class RunConfig:
    model: dict[str, Any]
    data: dict[str, Any]
    train: TrainSettings = field(default_factory=TrainSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    wandb: WandbSettings = field(default_factory=WandbSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    seed: int
    device: str  # auto | cpu | cuda | mps
    dtype: str  # auto | float32 | bfloat16 | float16
    compile: bool

    def __post_init__(self) -> None:
        non_negative_int("seed", self.seed)
        choice("device", self.device, ("auto", "cpu", "cuda", "mps"))
        choice("dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        boolean("compile", self.compile)
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


def _build(kind: type, values: dict[str, Any], prefix: str) -> Any:
    """kind(**values); `prefix` ("optim." or "") names the section in the error."""
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]}; known keys: "
            + ", ".join(f"{prefix}{n}" for n in sorted(names))
        )
    return kind(**values)
