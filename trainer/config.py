"""The run configuration as typed, validated dataclasses.

Hydra composes configs/train.yaml into a tree of plain values; `RunConfig.from_dict` checks every
field once, up front, so a bad override (`train.batch_size=abc`, `optim.lr=-1`) fails in one line
naming the key, before any data is prepared or memory is allocated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from core.errors import ConfigError


def _positive_int(key: str, value: Any, allow_zero: bool = False) -> int:
    ok = (
        isinstance(value, int) and not isinstance(value, bool) and value >= (0 if allow_zero else 1)
    )
    if not ok:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{key} must be {kind} integer, got {value!r}")
    return value


def _number(key: str, value: Any, low: float | None = None, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ConfigError(f"{key} must be in [{low}, {high}], got {value!r}")
    return float(value)


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


@dataclass
class TrainSettings:
    batch_size: int = 16  # sequences per micro-batch (per rank when distributed)
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    max_steps: int = 1000  # optimizer steps
    # wall-clock budget for the training loop; the lr schedule then decays by time as well
    max_seconds: float | None = None
    eval_interval: int = 100  # steps between evaluations (0: only at the end)
    eval_steps: int = 20  # batches per periodic evaluation (a fixed subset of val)
    ckpt_interval: int = 100  # steps between `last` checkpoints (0: only at the end)
    log_interval: int = 10  # steps between console / wandb lines
    resume: str | None = None  # null | auto | a checkpoint or run directory
    on_nan: str = "stop"  # stop | skip: what a non-finite loss or gradient does
    sample_tokens: int = 64  # tokens per sample generation logged at each evaluation (0: none)

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum_steps", "max_steps", "eval_steps", "log_interval"):
            _positive_int(f"train.{name}", getattr(self, name))
        for name in ("eval_interval", "ckpt_interval", "sample_tokens"):
            _positive_int(f"train.{name}", getattr(self, name), allow_zero=True)
        if self.max_seconds is not None and _number("train.max_seconds", self.max_seconds) <= 0:
            raise ConfigError(f"train.max_seconds must be positive or null, got {self.max_seconds}")
        if self.resume is not None and not isinstance(self.resume, str):
            raise ConfigError(f"train.resume must be null, auto or a path, got {self.resume!r}")
        _choice("train.on_nan", self.on_nan, ("stop", "skip"))


@dataclass
class OptimSettings:
    """The optimizer and its learning-rate schedule (trainer/optim.py, trainer/muon.py).

    name=adamw: AdamW on every parameter. name=muon: Muon on the 2-D weight matrices inside the
    transformer blocks, AdamW (lr, betas, eps, weight_decay) on everything else. The schedule
    scales every group's peak rate (lr, muon_lr) by the same factor."""

    name: str = "adamw"  # adamw | muon
    lr: float = 1e-3  # peak learning rate (under muon: of the AdamW part)
    min_lr: float = 1e-4  # the schedule's floor
    weight_decay: float = 0.1  # on matrices and embeddings, never on biases and norms
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100  # linear warmup from lr / warmup_steps to lr
    schedule: str = "cosine"  # cosine | wsd | constant
    decay_fraction: float = 0.2  # wsd: the final fraction of steps (or max_seconds) that decays
    grad_clip: float = 1.0  # max global gradient norm (0: no clipping)
    # name=muon only: the block matrices' optimizer (ignored by adamw)
    muon_lr: float = 0.02  # peak learning rate of the Muon group
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations that orthogonalize each update
    muon_weight_decay: float = 0.0  # decoupled, as AdamW's: p -= lr * wd * p

    def __post_init__(self) -> None:
        _choice("optim.name", self.name, ("adamw", "muon"))
        _number("optim.lr", self.lr, low=0.0)
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be positive, got {self.lr}")
        _number("optim.min_lr", self.min_lr, low=0.0)
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr ({self.min_lr}) must not exceed optim.lr ({self.lr})")
        _number("optim.weight_decay", self.weight_decay, low=0.0)
        if not (isinstance(self.betas, (list, tuple)) and len(self.betas) == 2):
            raise ConfigError(f"optim.betas must be a pair like [0.9, 0.95], got {self.betas!r}")
        self.betas = tuple(_number("optim.betas", b, 0.0, 0.999999) for b in self.betas)
        _number("optim.eps", self.eps, low=0.0)
        _positive_int("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        _choice("optim.schedule", self.schedule, ("cosine", "wsd", "constant"))
        _number("optim.decay_fraction", self.decay_fraction, 0.0, 1.0)
        _number("optim.grad_clip", self.grad_clip, low=0.0)
        if _number("optim.muon_lr", self.muon_lr) <= 0:
            raise ConfigError(f"optim.muon_lr must be positive, got {self.muon_lr}")
        if not 0 <= _number("optim.muon_momentum", self.muon_momentum) < 1:
            raise ConfigError(f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        _bool("optim.muon_nesterov", self.muon_nesterov)
        _positive_int("optim.muon_ns_steps", self.muon_ns_steps)
        _number("optim.muon_weight_decay", self.muon_weight_decay, low=0.0)


@dataclass
class WandbSettings:
    mode: str = "auto"  # auto: online when logged in, else offline | online | offline | disabled
    project: str = "causalgpt"
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    entity: str | None = None

    def __post_init__(self) -> None:
        _choice("wandb.mode", self.mode, ("auto", "online", "offline", "disabled"))
        if not isinstance(self.tags, (list, tuple)):
            raise ConfigError(f"wandb.tags must be a list like [a,b], got {self.tags!r}")
        self.tags = [str(t) for t in self.tags]


@dataclass
class ParallelSettings:
    """Multi-process training under torchrun; a single process ignores this section."""

    strategy: str = "ddp"  # ddp: a full replica per rank | fsdp: weights, grads, optimizer sharded
    timeout_s: float = 300.0  # a collective waiting longer than this fails the job (a rank died)

    def __post_init__(self) -> None:
        _choice("parallel.strategy", self.strategy, ("ddp", "fsdp"))
        if _number("parallel.timeout_s", self.timeout_s) <= 0:
            raise ConfigError(f"parallel.timeout_s must be positive, got {self.timeout_s}")


@dataclass
class RunConfig:
    model: dict[str, Any]
    data: dict[str, Any]
    train: TrainSettings = field(default_factory=TrainSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    wandb: WandbSettings = field(default_factory=WandbSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | mps
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    compile: bool = False

    def __post_init__(self) -> None:
        _positive_int("seed", self.seed, allow_zero=True)
        _choice("device", self.device, ("auto", "cpu", "cuda", "mps"))
        _choice("dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _bool("compile", self.compile)
        if self.compile and self.model.get("attention") == "flash" and self.model.get("dropout"):
            raise ConfigError(
                "compile=true with model.attention=flash and model.dropout > 0 breaks the compiled "
                "graph at every tile (a random generator per tile); use model.attention=sdpa, "
                "model.dropout=0 or compile=false"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """Build from a resolved config tree; unknown keys are named in the error."""
        values = dict(values)
        values.pop("experiment", None)  # the recipe's name; its values are already merged in
        sections = {
            "train": TrainSettings,
            "optim": OptimSettings,
            "wandb": WandbSettings,
            "parallel": ParallelSettings,
        }
        for key, kind in sections.items():
            if key in values:
                values[key] = _build(kind, values[key] or {}, key)
        return _build(cls, values, "")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(kind: type, values: dict[str, Any], prefix: str) -> Any:
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key {where}{unknown[0]}; known keys: "
            + ", ".join(f"{where}{n}" for n in sorted(names))
        )
    return kind(**values)
