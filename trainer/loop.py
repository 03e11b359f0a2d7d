"""The training loop: next-token prediction with AdamW or Muon, evaluation, checkpoints, resume.

One optimizer step = `grad_accum_steps` micro-batches of `batch_size` windows on each of
`world_size` ranks. Everything a resumed run needs to continue exactly where it stopped (weights,
optimizer, step, RNG, data position, best loss, elapsed time) is in the `last` checkpoint.

Under torchrun (see hardware/distributed.py) every rank runs this same loop on its own slice of
each batch; decisions (a non-finite loss, a signal, the time budget) are agreed on by all ranks
so that they stop at the same step, and rank 0 alone prints, logs and writes checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import math
import shlex
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from base.errors import ConfigError
from checkpoints.store import Checkpoint, pretrained_model
from data.chat import IM_END
from data.loader import BatchSampler, PrefetchingSampler, eval_tokens
from data.pipeline import prepare_data
from evals.loss import EvalResult, Progress, evaluate
from hardware import distributed
from hardware.device import (
    Precision,
    configure_backends,
    peak_flops,
    resolve_device,
    resolve_precision,
)
from inference.generate import SamplingParams, generate
from model import GPT, GPTConfig, eval_mode
from trainer.checkpointing import CheckpointManager, Stateful
from trainer.config import RunConfig
from trainer.optim import build_optimizer, lr_scale, set_lr, warmup_drop
from trainer.preflight import causality_guard, check_memory
from trainer.reporting import MetricsLog, Tracker, format_metrics, format_seconds

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
MAX_SKIPPED_STEPS = 10  # train.on_nan=skip gives up after this many
SAMPLE_PY = Path(__file__).resolve().parents[1] / "sample.py"
TRAIN_PY = SAMPLE_PY.with_name("train.py")
EVALUATE_PY = SAMPLE_PY.with_name("evaluate.py")


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss); the message names the step and what was kept."""


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM arrived; a checkpoint was saved. Carries the signal number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    best_val_loss: float = math.inf
    elapsed: float = 0.0  # seconds spent in the training loop, summed over resumes
    skipped_steps: int = 0  # steps skipped for a non-finite loss (train.on_nan=skip)
    wandb_id: str | None = None


# What to do with an optimizer step whose loss or gradients are not finite.
#
# Two different events look alike: float16 gradients overflowing (routine under a gradient scaler:
# the scaler lowers its scale and skips the step) and the run diverging (the loss itself is NaN or
# inf: train.on_nan decides). Only non-finite gradients with a finite loss are the scaler's
# business; a non-finite loss is divergence whatever the precision, or a diverged float16 run
# would keep halving its scale forever and never reach train.on_nan.
Verdict = Literal["step", "scaler_skip", "diverged"]


def step_verdict(loss_finite: bool, grads_finite: bool, scaled: bool) -> Verdict:
    """ "step": apply the update. "scaler_skip": float16 overflow, the scaler skips and backs off
    (only with a gradient scaler, `scaled`). "diverged": the train.on_nan path."""
    if loss_finite and grads_finite:
        return "step"
    return "scaler_skip" if loss_finite and scaled else "diverged"


@contextlib.contextmanager
def stop_signals() -> Iterator[list[int]]:
    """SIGINT and SIGTERM as a flag the loop checks between steps: the received signals."""
    received: list[int] = []
    previous = {s: signal.signal(s, lambda n, _: received.append(n)) for s in STOP_SIGNALS}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@dataclass(frozen=True)
class Budget:
    """How long a run trains: train.max_steps, train.max_seconds (of training-loop time, summed
    over resumes) or both, whichever comes first. The one place that knows it: the schedule's
    progress by time, the time left, and whether the time is spent."""

    max_steps: int | None
    max_seconds: float | None

    def __str__(self) -> str:
        steps = f"{self.max_steps:,} steps" if self.max_steps else ""
        if not self.max_seconds:
            return steps
        clock = f"{self.max_seconds:g} s of training (train.max_seconds)"
        return f"{steps} or {clock}, whichever comes first" if steps else clock

    def time_fraction(self, elapsed: float) -> float:
        """How far the clock is through the budget (0 without one): the schedule decays by it."""
        return elapsed / self.max_seconds if self.max_seconds else 0.0

    def left_out(self, final_eval: str, val_tokens: int) -> str:
        """What the clock does not count, said at the start (issue 50: 300 s ran 504 s)."""
        if not self.max_seconds:
            return ""
        final = {
            "whole": f" and the final evaluation of the whole validation split ({val_tokens:,} "
            "tokens; train.final_eval=periodic evaluates train.eval_steps batches instead)",
            "periodic": " and the final evaluation (train.eval_steps batches)",
            "none": "",
        }[final_eval]
        return f"\nnot counted in train.max_seconds: start-up{final}"

    def spent(self, elapsed: float) -> bool:
        return self.max_seconds is not None and elapsed >= self.max_seconds

    def last_step(self, step: int) -> bool:
        """Whether `step` is train.max_steps' (never, under a time budget alone)."""
        return self.max_steps is not None and step >= self.max_steps

    def done(self, step: int, elapsed: float) -> bool:
        return self.last_step(step) or self.spent(elapsed)

    def eta(self, step: int, elapsed: float, seconds_per_step: float) -> float:
        left = ((self.max_steps or math.inf) - step) * seconds_per_step
        return left if self.max_seconds is None else min(left, self.max_seconds - elapsed)


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: str | Path, resolved_config: dict[str, Any]):
        self.cfg, train = cfg, cfg.train
        self.budget = Budget(train.max_steps, train.max_seconds)
        # The same seed on every rank: identical initial weights (FSDP shards each rank's copy)
        # and RNG streams that stay identical (dropout draws the same shapes on every rank), so
        # rank 0's RNG state, saved in checkpoints, is every rank's.
        torch.manual_seed(cfg.seed)
        self.dist = distributed.DistInfo.from_env()
        sharded = self.dist.enabled and cfg.parallel.strategy == "fsdp"
        self.device, self.precision = self._machine(sharded)
        self.run_dir = Path(distributed.from_main(str(run_dir)))
        self.progress = Progress(self.budget.max_steps, "step", enabled=self.dist.is_main)
        # The data first (rank 0 alone verifies every byte), so that its mistakes are reported
        # first; then the model it sizes, proved causal, and the tasks scored at evaluations.
        self.data = distributed.run_on_main(lambda: prepare_data(cfg.data))
        distributed.check_visible(self.data)
        self.model = self._new_model(self.dist.world_size if sharded else 1)
        self.tasks = self._tasks()
        # A resumed run's weights, before FSDP shards the model; then the parallel wrapper and
        # the optimizer over the (sharded) parameters. Two handles on one model: `model`, the
        # plain one (evaluation, checkpoints, clipping), and `step_model`, what training steps
        # run through (DDP-wrapped or FSDP-sharded, compiled with compile=true).
        self.checkpoints = CheckpointManager(
            self.run_dir, resolved_config, self.data, train.keep_checkpoints, self.dist,
            say=self.progress.message, sharded=cfg.parallel.checkpoint == "sharded",
        )  # fmt: skip
        # rank 0 repairs an interrupted checkpoint swap before the others read
        with distributed.main_first():
            resume_from = self.checkpoints.resume_checkpoint(train.resume, self.model.config)
        if resume_from is not None:
            self.model.load_state_dict(resume_from.model.state_dict())
        self.step_model = distributed.wrap_model(
            self.model, cfg.parallel.strategy, self.dist, self.device, self.precision.dtype,
            compile=cfg.compile,
        )  # fmt: skip
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        scaled = self.precision.needs_grad_scaler  # float16; else the scaler passes all through
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=scaled)
        self.sampler = self._sampler()
        self.state = TrainState()  # with the others, what `last` holds besides the weights
        self.stateful = self._stateful()
        self.resumed_from = None if resume_from is None else resume_from.path
        if resume_from is not None:
            self._resume(resume_from)
        self._reporting(resolved_config)  # last: a failure above leaves no wandb run behind

    def _machine(self, sharded: bool) -> tuple[torch.device, Precision]:
        """The device (this rank's, under torchrun) and its precision, refusing what FSDP
        cannot do."""
        cfg = self.cfg
        if sharded and cfg.optim.name == "muon":
            raise ConfigError(
                "optim.name=muon is not supported with parallel.strategy=fsdp (Muon needs whole "
                "matrices); use parallel.strategy=ddp"
            )
        device = distributed.init_distributed(
            self.dist, resolve_device(cfg.device), cfg.parallel.timeout_s
        )
        precision = resolve_precision(device, cfg.dtype)
        if sharded and precision.needs_grad_scaler:
            raise ConfigError("parallel.strategy=fsdp does not support float16; use bfloat16")
        configure_backends(device)
        return device, precision

    def _new_model(self, shards: int) -> GPT:
        """The model on the device: train.init_from's pretrained weights (the source fixes the
        architecture), else a new one the config and the tokenizer size. The causality guard
        checks it first (trainer/preflight.py: the loaded weights, or a shrunk copy of the new
        architecture), and its memory is estimated before it is allocated: a run that cannot
        fit is refused."""
        cfg, init_from = self.cfg, self.cfg.train.init_from
        model = pretrained_model(init_from, cfg.model, self.data) if init_from else None
        if model is not None and self.dist.is_main:
            where = cfg.data.get("tokenizer_dir")
            read = f" (its tokenizer.json in {where})" if where else ""
            print(f"tokenizer {self.data.tokenizer_name}{read}: train.init_from={init_from}'s own")
        self.causality = causality_guard(cfg, self.dist.is_main, model, self.device)
        if model is not None:
            config = model.config
        else:  # `vocab_size: null` is the tokenizer's size
            vocab, tokenizer_vocab = cfg.model.get("vocab_size"), self.data.vocab_size
            if vocab is not None and vocab < tokenizer_vocab:
                raise ConfigError(
                    f"model.vocab_size={vocab} is smaller than the tokenizer's {tokenizer_vocab} "
                    "tokens; set model.vocab_size=null to use the tokenizer's size"
                )
            config = GPTConfig.from_dict({**cfg.model, "vocab_size": vocab or tokenizer_vocab})
        _, memory = check_memory(config, cfg, self.precision, shards)
        if self.dist.is_main:
            print(memory)
        return (GPT(config) if model is None else model).to(self.device)

    def _tasks(self) -> list:
        """train.eval_tasks, scored at each evaluation: the first eval_task_items of each."""
        if not self.cfg.train.eval_tasks:
            return []
        from evals.tasks import load_task, task_config  # loaded for tasks alone

        tasks = []
        # rank 0 downloads a hub task once; the others read its cache
        with distributed.main_first():
            tokenizer, block_size = self.data.tokenizer(), self.model.config.block_size
            for name in self.cfg.train.eval_tasks:
                task = {**task_config(name), "limit": self.cfg.train.eval_task_items}
                tasks.append(load_task(task, tokenizer, block_size))
        return tasks

    def _sampler(self) -> BatchSampler | PrefetchingSampler:
        """This rank's training batches; on a GPU built ahead in pinned memory (data/loader.py)."""
        train, dist = self.cfg.train, self.dist
        tokens, mask = self.data.tokens("train"), self.data.mask("train")
        block_size = self.model.config.block_size
        sampler = BatchSampler(
            tokens, block_size, train.batch_size, self.cfg.seed, dist.rank, dist.world_size, mask
        )
        cuda = self.device.type == "cuda"
        return PrefetchingSampler(sampler, pin_memory=True) if cuda else sampler

    def _stateful(self) -> Stateful:
        """The training state, in one place: what `last` holds besides the weights, by name."""
        model, optimizer, scaler = self.model, self.optimizer, self.scaler
        sharded = self.checkpoints.sharded  # its moments as they are, each rank's own rows
        stateful: Stateful = {
            "train_state": (lambda: asdict(self.state), lambda s: vars(self.state).update(s)),
            "optimizer": (
                lambda: distributed.optimizer_state(model, optimizer, gather=not sharded),
                lambda state: distributed.load_optimizer_state(model, optimizer, state),
            ),
            "sampler": (self.sampler.state_dict, self.sampler.load_state_dict),
            "torch_rng": (torch.get_rng_state, torch.set_rng_state),
        }
        if self.device.type == "cuda":
            stateful["cuda_rng"] = (torch.cuda.get_rng_state, torch.cuda.set_rng_state)
        if scaler.is_enabled():
            stateful["scaler"] = (scaler.state_dict, scaler.load_state_dict)
        return stateful

    def _resume(self, ckpt: Checkpoint) -> None:
        """Every state of `ckpt` but the weights; refused when its budget is already spent."""
        self.checkpoints.restore(ckpt, self.stateful)
        self.state.best_val_loss = min(self.state.best_val_loss, self.checkpoints.best_loss())
        if self.budget.done(self.state.step, self.state.elapsed):  # its end already ran
            raise ConfigError(
                f"the run resumed from {ckpt.path} has already trained {self.state.step} steps "
                f"({format_seconds(self.state.elapsed)}): its budget, {self.budget}, is spent; "
                "raise train.max_steps or train.max_seconds to train longer, or evaluate it: "
                f"{shlex.join(['python', str(EVALUATE_PY), f'checkpoint={ckpt.path}'])}"
            )

    def _reporting(self, resolved_config: dict[str, Any]) -> None:
        """Tokens/s and MFU (every rank's tokens), the tracker (a wandb run), metrics.jsonl."""
        train, world = self.cfg.train, self.dist.world_size
        block_size = self.model.config.block_size
        self.tokens_per_step = train.batch_size * train.grad_accum_steps * world * block_size
        self._mfu_peak(world, block_size)
        self.tracker = Tracker(
            self.cfg.wandb, self.run_dir, resolved_config, self.state.wandb_id,
            enabled=self.dist.is_main,
        )  # fmt: skip
        self.state.wandb_id = self.tracker.run_id
        self.metrics = MetricsLog(
            self.run_dir, self.tokens_per_step, self.state.step, self.dist.is_main
        )
        # Samples are generated only for a tracker that records them: by every rank (under FSDP
        # each forward is a collective), as rank 0's tracker decides (wandb.mode or WANDB_MODE).
        self.records_samples = bool(train.sample_tokens) and distributed.from_main(
            self.tracker.run is not None
        )
        self.last_eval: tuple[int, EvalResult] | None = None  # (step, the latest evaluation)
        self.best_at: int | None = None  # the step of the `best` this process saved last
        # optim.warmup_steps under a time budget: warned of at the first logged step, once the
        # speed is known (see _log); nothing to warn of when no warmup lies ahead
        self.warmup_told = not train.max_seconds or self.state.step >= self.cfg.optim.warmup_steps

    # ----- checkpoints ---------------------------------------------------------------------

    def _meta(self, **extra: Any) -> dict[str, Any]:
        return {
            "step": self.state.step,
            "tokenizer": self.data.tokenizer_name,
            "data_sha256": self.checkpoints.data_sha256,
            "causality": self.causality,
            **({"chat_template": self.data.chat_template} if self.data.chat_template else {}),
            **extra,
        }

    def save(self, name: str, with_trainer_state: bool = True, **meta: Any) -> Path:
        """Every rank calls this at the same step (see trainer/checkpointing.py)."""
        stateful = self.stateful if with_trainer_state else None
        return self.checkpoints.save(name, self.model, self._meta(**meta), stateful)

    # ----- evaluation ----------------------------------------------------------------------

    def val_loss(self, whole_split: bool = False) -> EvalResult:
        """The eval_steps subset, or the whole split with progress shown as evaluate.py shows
        it (minutes on a CPU)."""
        tokens, shown = self.data.tokens("val"), whole_split and self.dist.is_main
        block, rank, world = self.model.config.block_size, self.dist.rank, self.dist.world_size
        mask = self.data.mask("val")
        if shown:
            what = f"{len(tokens) - 1:,} tokens"
            if mask is not None:
                what += f" ({eval_tokens(len(tokens), block, mask=mask):,} scored: the assistant's)"
            self.progress.message(f"final evaluation: the whole validation split, {what}")
        share = eval_tokens(len(tokens), block, rank, world, mask)  # this rank's, which it counts
        nbytes, batches = self.data.meta["splits"]["val"]["bytes"], self.cfg.train.eval_steps
        with Progress(share, "token", enabled=shown) as progress:
            return evaluate(
                self.model, tokens, nbytes, self.cfg.train.batch_size, self.precision,
                max_batches=None if whole_split else batches,
                rank=rank, world_size=world, progress=progress.update, mask=mask,
            )  # fmt: skip

    # ----- training ------------------------------------------------------------------------

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (this rank's loss, gradient norm before clipping: the
        same on every rank). No collective and no host read but the step's health (one small
        tensor): the loss is averaged over ranks only where it is logged."""
        cfg, step = self.cfg, self.state.step
        time_fraction = self.budget.time_fraction(self.state.elapsed)  # see lr_scale
        set_lr(self.optimizer, lr_scale(step, cfg.optim, self.budget.max_steps, time_fraction))
        accum = cfg.train.grad_accum_steps
        # The step's loss is the mean over all of its targets, on every rank and micro-batch (a
        # chat batch's assistant tokens vary in number): each micro-batch's summed loss over
        # that count, known to every rank without a collective, times the world size, as DDP
        # averages gradients over ranks.
        first = self.sampler.state_dict()["step"]
        targets = sum(self.sampler.targets(first + i) for i in range(accum))
        per_target = self.dist.world_size / max(targets, 1)
        loss_sum = torch.zeros((), device=self.device)
        for i in range(accum):
            x, y = self.sampler.next_batch()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with distributed.gradient_sync(self.step_model, enabled=i == accum - 1):
                with self.precision.autocast():
                    _, loss = self.step_model(x, y, loss_reduction="sum")
                loss = loss * per_target
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        self.scaler.unscale_(self.optimizer)
        # optim.grad_clip=0: no clipping
        grad_norm = distributed.clip_grad_norm(self.model, cfg.optim.grad_clip or math.inf)
        verdict = self._verdict(loss_sum, grad_norm)
        if verdict == "step":
            self.scaler.step(self.optimizer)
        self.scaler.update()  # after unscale_, on every step: a skipped one lowers its scale
        self.optimizer.zero_grad(set_to_none=True)
        if verdict == "diverged":
            self._non_finite(loss_sum, grad_norm)
        return loss_sum, grad_norm

    def _verdict(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Verdict:
        """The step's verdict, the same on every rank. The gradient norm is the same everywhere
        (gradients are reduced), so only when it is not finite do the ranks agree on whether any
        rank's loss was: a collective on that rare step alone."""
        # One host read for both.
        loss_finite, grads_finite = torch.stack([loss.isfinite(), grad_norm.isfinite()]).tolist()
        if not grads_finite:
            loss_finite = not distributed.all_reduce_max([not loss_finite], self.device)[0]
        return step_verdict(loss_finite, grads_finite, scaled=self.scaler.is_enabled())

    def _non_finite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        what = f"loss {loss.item():.4g}, gradient norm {grad_norm.item():.4g}"
        self.state.skipped_steps += 1
        if self.cfg.train.on_nan == "skip" and self.state.skipped_steps <= MAX_SKIPPED_STEPS:
            self.progress.message(f"step {self.state.step + 1}: non-finite {what}; step skipped")
            return
        last = self.checkpoints.dir / "last"
        kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was saved"
        raise TrainingError(
            f"non-finite {what} at step {self.state.step + 1}; stopping ({kept}). "
            "Try a lower optim.lr, optim.grad_clip=1.0, or train.on_nan=skip"
        )

    def run(self) -> dict[str, Any]:
        """Train to max_steps or max_seconds, then evaluate the whole validation split.
        Returns the final summary (also printed as the last line, as JSON)."""
        self._announce()
        exit_code = 1
        try:
            with stop_signals() as received:
                self._loop(received)
            summary = self._finish()
            exit_code = 0
        finally:
            self.progress.close()
            self.metrics.close()
            self.tracker.finish(exit_code)
            if isinstance(self.sampler, PrefetchingSampler):
                self.sampler.close()
            # The DDP wrapper holds the process group; freed after it, at exit, gloo can hang.
            self.step_model = self.model
            distributed.destroy(clean=exit_code == 0)
        self._report(summary)
        return summary

    def _loop(self, received: list[int]) -> None:
        cfg, state = self.cfg.train, self.state
        # the clock: seconds in the training loop, summed over resumes
        started = time.perf_counter() - state.elapsed
        timed_from, timed_steps = time.perf_counter(), 0  # tokens/s is timed_steps over this
        first_step = state.step
        signum, out_of_time = self._stop_requested(received)
        while not (self.budget.last_step(state.step) or out_of_time):
            loss, grad_norm = self.train_step()
            state.step += 1
            timed_steps += 1
            state.elapsed = time.perf_counter() - started
            logged = state.step % cfg.log_interval == 0 or self.budget.last_step(state.step)
            if logged:
                tok_s = timed_steps * self.tokens_per_step / (time.perf_counter() - timed_from)
                self._log(loss, grad_norm, tok_s)
            evaluated = bool(cfg.eval_interval) and state.step % cfg.eval_interval == 0
            if evaluated:
                self._validate()
            if cfg.ckpt_interval and state.step % cfg.ckpt_interval == 0:
                self.checkpoints.save_periodic(self.model, self._meta(), self.stateful)
            if logged or state.step == first_step + 1:  # the speed counts no compiling,
                timed_from, timed_steps = time.perf_counter(), 0  # evaluation or save
            # Decided after the evaluation: a budget it spends ends the run at this step, whose
            # evaluation is then the final one (not a second one, a step later).
            state.elapsed = time.perf_counter() - started
            signum, out_of_time = self._stop_requested(received, agree=logged or evaluated)
            if signum:
                self._interrupted(signum)

    def _announce(self) -> None:
        """What is about to be trained, on what, for how long, and where it goes; then the bar."""
        world, train = self.dist.world_size, self.cfg.train
        ranks = f", {world} ranks ({self.cfg.parallel.strategy})" if self.dist.enabled else ""
        val, budget = len(self.data.tokens("val")), f"budget: {self.budget}"
        budget += self.budget.left_out(train.final_eval, val)
        self.progress.message(
            f"run dir: {self.run_dir}\n"
            f"model: {self.model.num_params() / 1e6:.2f}M parameters, {self.model.config}\n"
            f"data: {self.data.meta['dataset']} ({self.data.tokenizer_name}), "
            f"{len(self.data.tokens('train')):,} train / {val:,} val "
            f"tokens\ndevice: {self.device}{ranks}, {self.precision.dtype}"
            f"{f' ({self.precision.why})' if self.precision.why else ''}, "
            f"MFU vs {self.peak_source}\n{budget}\n{self.tracker.location}"
        )
        resumed = f"resumed from {self.resumed_from} at step {self.state.step}"
        if self.dist.restart:
            self._restarted(resumed if self.resumed_from else "no checkpoint yet, so from step 0")
        elif self.resumed_from is not None:
            self.progress.message(resumed)
        elif self.cfg.train.resume == "auto":  # said: a mistyped hydra.run.dir resumes nothing
            self.progress.message(
                f"train.resume=auto: no checkpoint in {self.run_dir} yet, so from step 0"
            )
        self.progress.start(self.state.step)

    def _restarted(self, resumed: str) -> None:
        """A torchrun restart of the job's workers (--max-restarts): where it resumed, and what
        it cost, in the log and in the first metrics row after it."""
        restart, repeated, quiet = self.dist.restart, self.metrics.repeated, self.metrics.quiet_for
        self.progress.message(
            f"torchrun restart {restart}: {resumed}\ntorchrun restart {restart}: {repeated} "
            f"logged steps to do again; {quiet:.1f} s since the last metrics row"
        )
        cost = {"restart": restart, "restart/repeated_steps": repeated}
        self._record(cost | {"restart/seconds_since_last_row": quiet}, self.state.step + 1)

    def _stop_requested(self, received: list[int], agree: bool = True) -> tuple[int, bool]:
        """(the signal received, or 0; the time budget is spent), agreed on by all ranks: a
        signal or clock on any one of them stops every rank after the same step. Under torchrun
        the ranks agree at logged steps and evaluations only (`agree`), so that no other step
        waits on a collective; a single process decides at every step."""
        if self.dist.enabled and not agree:
            return 0, False
        local = [received[-1] if received else 0, self.budget.spent(self.state.elapsed)]
        signum, late = distributed.all_reduce_max(local, self.device)
        return int(signum), bool(late)

    def _log(self, loss: torch.Tensor, grad_norm: torch.Tensor, tok_s: float) -> None:
        if not self.warmup_told:
            self._warn_warmup(tok_s)
        values = {
            "loss": distributed.mean_over_ranks(loss).item(),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm.item(),
            "tok/s": tok_s,
            **self._mfu(tok_s),
        }
        step = self.state.step
        eta = self.budget.eta(step, self.state.elapsed, self.tokens_per_step / tok_s)
        self.progress.update(step, f"{format_metrics(values)} | eta {format_seconds(eta)}")
        metrics = {f"train/{k.replace('tok/s', 'tokens_per_s')}": v for k, v in values.items()}
        self._record(metrics, step)

    def _warn_warmup(self, tok_s: float) -> None:
        """At the first logged step: where the clock will be when warmup ends, at this speed."""
        steps_left = max(self.cfg.optim.warmup_steps - self.state.step, 0)
        ends = self.state.elapsed + steps_left * self.tokens_per_step / tok_s
        fraction = self.budget.time_fraction(ends)
        if warning := warmup_drop(self.cfg.optim, self.budget.max_steps, fraction):
            self.progress.message(warning)
        self.warmup_told = True

    def _mfu_peak(self, world: int, block_size: int) -> None:
        """The peak tokens/s of every rank together: the device's FLOP/s over a token's."""
        self.tokens_per_flop = world / self.model.flops_per_token(block_size)
        peak, self.peak_source = peak_flops(self.precision)
        self.peak_tokens_per_s = peak and peak * self.tokens_per_flop
        self.peak_remeasured = False

    def _mfu(self, tok_s: float) -> dict[str, float]:
        """{"mfu": tokens/s over the peak}, or {} where no peak is known."""
        if not self.peak_tokens_per_s:
            return {}
        if tok_s > self.peak_tokens_per_s and self.device.type == "cpu":
            self._raise_peak(tok_s)
        return {"mfu": tok_s / self.peak_tokens_per_s}

    def _raise_peak(self, tok_s: float) -> None:
        """The run beat the CPU's peak: it was measured on a busy machine. Measure it again,
        once a run, and never report a peak below a rate the run achieved (MFU <= 100%)."""
        if not self.peak_remeasured:
            self.peak_remeasured = True
            peak, _ = peak_flops(self.precision, remeasure=True)
            self.peak_tokens_per_s = peak * self.tokens_per_flop
        self.peak_tokens_per_s = max(self.peak_tokens_per_s, tok_s)

    def _record(self, metrics: dict[str, Any], step: int) -> None:
        """One row to wandb and to <run_dir>/metrics.jsonl."""
        self.tracker.log(metrics, step)
        self.metrics.log(metrics, step)

    def _interrupted(self, signum: int) -> None:
        """Save `last` and stop with the command that resumes."""
        path = self.save("last")
        launcher = "torchrun <flags>" if self.dist.enabled else "python"
        command = shlex.join([str(TRAIN_PY), f"hydra.run.dir={self.run_dir}", "train.resume=auto"])
        name = signal.Signals(signum).name
        how = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {name}"
        raise TrainingInterrupted(
            signum,
            f"{how} at step {self.state.step}; checkpoint saved to {path}. "
            f"Resume with: {launcher} {command}",
        )

    def _validate(self) -> EvalResult:
        """Score the eval_steps subset of val and the tasks, and report them (console, wandb,
        metrics.jsonl, samples); save `best` when the loss is the lowest yet. At eval_interval
        steps, and at the end (train.final_eval)."""
        result = self.val_loss()
        improved = result.loss < self.state.best_val_loss
        if improved:
            self.state.best_val_loss, self.best_at = result.loss, self.state.step
            self.save("best", with_trainer_state=False, val_loss=result.loss, val_bpb=result.bpb)
        spread = "" if math.isnan(result.stderr) else f" ± {result.stderr:.4f}"  # one batch: none
        self.progress.message(
            f"step {self.state.step} | val loss {result.loss:.4f}{spread} "
            f"| val bpb {result.bpb:.4f}{' | best' if improved else ''}"
        )
        self._record(result.metrics("val") | self._task_metrics(), self.state.step)
        self.metrics.plot()
        if self.records_samples:
            self.tracker.log_samples(self._samples(), self.state.step)
        self.last_eval = (self.state.step, result)
        return result

    def _task_metrics(self) -> dict[str, float]:
        """Score train.eval_tasks (each rank its share of the items), each in one line."""
        metrics, rank, world = {}, self.dist.rank, self.dist.world_size
        for task in self.tasks:
            from evals.tasks import score_task, task_line

            scores = score_task(self.model, task, self.precision, rank, world)
            self.progress.message(f"step {self.state.step} | {task_line(task.name, scores)}")
            metrics |= {
                f"{task.name}/{k}": v for k, v in scores.items() if k != "items" and v is not None
            }
        return metrics

    def _samples(self) -> list[tuple[str, str]]:
        """Completions of two fixed prompts (nothing, and the validation text's opening), or for
        a chat dataset the reply to the held-out split's first conversation up to its first
        assistant turn; drawn with their own seeded generator so that training's RNG stream is
        untouched."""
        tokenizer, val, mask = self.data.tokenizer(), self.data.tokens("val"), self.data.mask("val")
        end = eot = tokenizer.eot_token
        prompts = [[eot], [t for t in val[:17].tolist() if t != eot][:16]]
        if mask is not None:  # it ends with <|im_start|>assistant\n; the reply ends at <|im_end|>
            prompts = [val[: int(mask.argmax())].tolist()]
            end = tokenizer.encode_single_token(IM_END)
        generator = torch.Generator(self.device).manual_seed(self.cfg.seed)
        n = self.cfg.train.sample_tokens
        settings = dict(eot_token=end, vocab_size=tokenizer.n_vocab)
        rows = []
        for prompt in prompts:  # drawn with sample.py's SamplingParams
            idx = torch.tensor([prompt[-self.model.config.block_size :]], device=self.device)
            with eval_mode(self.model), self.precision.autocast():
                out = generate(self.model, idx, n, SamplingParams(), generator, **settings)
            new = [t for t in out[0, idx.size(1) :].tolist() if t != end]
            rows.append((tokenizer.decode([t for t in prompt if t != eot]), tokenizer.decode(new)))
        return rows

    def _finish(self) -> dict[str, Any]:
        """Always save the final state; evaluate as train.final_eval says (default: the whole
        validation split)."""
        cfg = self.cfg.train
        step, evaluated = self.last_eval or (None, None)
        if cfg.final_eval != "none" and step != self.state.step:
            evaluated = self._validate()  # the final model competes for `best` too
        last, best = self.save("last"), self.checkpoints.dir / "best"
        final = evaluated if cfg.final_eval == "periodic" else None  # eval_steps, at this step
        if cfg.final_eval == "whole":
            final = self.val_loss(whole_split=True)
            if self.best_at == self.state.step:  # `best` is this model: its whole-split score
                subset = {"val_loss": evaluated.loss, "val_bpb": evaluated.bpb}  # best compares
                whole = {"final_val_loss": final.loss, "final_val_bpb": final.bpb}
                self.save("best", False, **subset, **whole, final_val_tokens=final.tokens)
        summary = {
            "step": self.state.step,
            "train_seconds": round(self.state.elapsed, 2),
            "val_loss": None if final is None else round(final.loss, 4),
            "val_bpb": None if final is None else round(final.bpb, 4),
            "val_tokens": None if final is None else final.tokens,
            "final_eval": cfg.final_eval,
            "checkpoint": str(last),
            "best_checkpoint": str(best) if best.is_dir() else None,
        }
        if final is not None:
            self._record(final.metrics("final_val"), self.state.step)
            self.metrics.plot()
        self.tracker.summary(summary)
        return summary

    def _report(self, summary: dict[str, Any]) -> None:
        """The closing lines on rank 0, the summary as JSON last; every command printed works
        from any directory."""
        if not self.dist.is_main:
            return
        if summary["val_loss"] is None:
            result = " (train.final_eval=none: no final evaluation)"
        else:
            tokens, block = f"{summary['val_tokens']:,} tokens", self.model.config.block_size
            split = f"whole validation split ({tokens}, non-overlapping windows of {block})"
            if summary["final_eval"] != "whole":
                split = f"validation subset ({tokens}, train.eval_steps batches)"
            result = f"; {split}: loss {summary['val_loss']:.4f}, bpb {summary['val_bpb']:.4f}"
        sample = shlex.join(["python", str(SAMPLE_PY), f"checkpoint={self.run_dir.resolve()}"])
        sample += " chat=true" if self.data.chat_template else ""  # a conversation, for a chat run
        best = f" (best: {summary['best_checkpoint']})" if summary["best_checkpoint"] else ""
        print(
            f"done: {self.state.step} steps in {format_seconds(self.state.elapsed)}{result}\n"
            f"checkpoint: {summary['checkpoint']}{best}\n"
            f"metrics: {self.metrics.path} (plot: {self.metrics.plot_path})\n"
            f"sample: {sample}"
        )
        print(json.dumps(summary))
