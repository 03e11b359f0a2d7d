"""The training loop: next-token prediction with AdamW or Muon, evaluation, checkpoints, resume.

One optimizer step = `grad_accum_steps` micro-batches of `batch_size` windows on each of
`world_size` ranks. Everything a resumed run needs to continue exactly where it stopped (weights,
optimizer, step, RNG, data position, best loss, elapsed time) is in the `last` checkpoint.

Under torchrun (see trainer/distributed.py) every rank runs this same loop on its own slice of
each batch; decisions (a non-finite loss, a signal, the time budget) are agreed on by all ranks
so that they stop at the same step, and rank 0 alone prints, logs and writes checkpoints.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from core.checkpoint import (
    Checkpoint,
    CheckpointError,
    check_writable,
    load_checkpoint,
    recover_interrupted_swap,
    resolve_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from core.device import configure_backends, peak_flops, resolve_device, resolve_precision
from core.errors import ConfigError
from data import PreparedData, prepare
from data.prefetch import PrefetchingSampler
from data.sampler import BatchSampler
from data.tokenizer import tokenizer_fingerprint
from inference.generate import SamplingParams, generate
from model import GPT, GPTConfig
from trainer.config import RunConfig
from trainer.console import Progress, format_seconds
from trainer.distributed import (
    DistInfo,
    all_reduce_max,
    barrier,
    check_visible,
    clip_grad_norm,
    compile_model,
    destroy,
    from_main,
    full_model,
    gradient_sync,
    init_distributed,
    load_optimizer_state,
    main_first,
    mean_over_ranks,
    optimizer_state,
    run_on_main,
    wrap_model,
)
from trainer.evaluation import EvalResult, evaluate
from trainer.optim import build_optimizer, lr_scale, set_lr
from trainer.step_health import Verdict, step_verdict
from trainer.tracking import Tracker

MAX_SKIPPED_STEPS = 10  # train.on_nan=skip gives up after this many


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


class _StopSignals:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __enter__(self) -> _StopSignals:
        self._previous = {
            s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)
        }
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def model_config_for(model_values: dict[str, Any], data: PreparedData) -> GPTConfig:
    """The model config with `vocab_size: null` filled in from the tokenizer."""
    values = dict(model_values)
    if values.get("vocab_size") is None:
        values["vocab_size"] = data.vocab_size
    elif values["vocab_size"] < data.vocab_size:
        raise ValueError(
            f"model.vocab_size={values['vocab_size']} is smaller than the tokenizer's "
            f"{data.vocab_size} tokens; set model.vocab_size=null to use the tokenizer's size"
        )
    return GPTConfig.from_dict(values)


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: str | Path, resolved_config: dict[str, Any]):
        self.cfg = cfg
        self.resolved_config = resolved_config  # what gets saved and sent to wandb
        # The same seed on every rank: identical initial weights (FSDP shards each rank's copy)
        # and RNG streams that stay identical (dropout draws the same shapes on every rank), so
        # rank 0's RNG state, saved in checkpoints, is every rank's.
        torch.manual_seed(cfg.seed)

        self.dist = DistInfo.from_env()
        if self.dist.enabled and cfg.parallel.strategy == "fsdp" and cfg.optim.name == "muon":
            raise ConfigError(
                "optim.name=muon is not supported with parallel.strategy=fsdp (Muon needs whole "
                "matrices); use parallel.strategy=ddp"
            )
        self.device = init_distributed(
            self.dist, resolve_device(cfg.device), cfg.parallel.timeout_s
        )
        self.run_dir = Path(from_main(str(run_dir)))
        self.ckpt_dir = self.run_dir / "checkpoints"
        if self.dist.is_main:  # fail now, not at the first checkpoint
            check_writable(self.ckpt_dir)
        self.precision = resolve_precision(self.device, cfg.dtype)
        self.sharded = self.dist.enabled and cfg.parallel.strategy == "fsdp"
        if self.sharded and self.precision.needs_grad_scaler:
            raise ConfigError("parallel.strategy=fsdp does not support float16; use bfloat16")
        configure_backends(self.device)

        self.data = run_on_main(lambda: prepare(cfg.data))  # rank 0 alone verifies every byte
        check_visible(self.data)
        self.tokenizer = self.data.tokenizer()
        self.model = GPT(model_config_for(cfg.model, self.data)).to(self.device)
        self.block_size = self.model.config.block_size
        with main_first():  # rank 0 repairs an interrupted checkpoint swap before others read
            resume_from = self._resume_checkpoint()
        if resume_from is not None:  # weights before sharding: FSDP shards what is loaded
            self.model.load_state_dict(resume_from.model.state_dict())
        self.parallel_model = wrap_model(
            self.model, cfg.parallel.strategy, self.dist, self.device, self.precision.dtype
        )
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if self.precision.needs_grad_scaler else None
        )
        self.sampler = BatchSampler(
            self.data.tokens("train"),
            self.block_size,
            cfg.train.batch_size,
            cfg.seed,
            self.dist.rank,
            self.dist.world_size,
        )
        if self.device.type == "cuda":  # batches built ahead in pinned memory: see data/prefetch
            self.sampler = PrefetchingSampler(self.sampler, pin_memory=True)
        self.state = TrainState()
        self.losses: dict[int, float] = {}  # step -> training loss, at every logged step
        if resume_from is not None:
            self._resume(resume_from)
        self.step_model = (
            compile_model(self.model, self.parallel_model) if cfg.compile else self.parallel_model
        )

    # ----- checkpoints ---------------------------------------------------------------------

    def _resume_checkpoint(self) -> Checkpoint | None:
        """The checkpoint to resume from, if any (every rank reads it: the run directory must
        be on a filesystem that all nodes share)."""
        source = self._resume_source()
        if source is None:
            return None
        ckpt = load_checkpoint(source, with_trainer_state=True)
        if ckpt.model.config != self.model.config:
            raise CheckpointError(
                f"the checkpoint at {source} has model {ckpt.model.config.to_dict()}, but this "
                f"run's model is {self.model.config.to_dict()}; resume with the same model config"
            )
        data = self.data
        if tokenizer_fingerprint(ckpt.tokenizer_name, ckpt.path) != tokenizer_fingerprint(
            data.tokenizer_name, data.dir
        ):
            raise CheckpointError(
                f"the checkpoint at {source} was trained with another {ckpt.tokenizer_name} "
                f"tokenizer than this run's data ({data.tokenizer_name} in {data.dir}; a "
                "trained one changes with its training text); resume with the same data"
            )
        return ckpt

    def _resume(self, ckpt: Checkpoint) -> None:
        """Everything but the weights (loaded before wrapping the model)."""
        state = ckpt.trainer_state
        load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.state = TrainState(**state["train_state"])
        # A kill after a `best` write and before the next `last` leaves a `best` that `last`'s
        # state does not know: a worse model must not replace it.
        self.state.best_val_loss = min(self.state.best_val_loss, self._best_on_disk())
        self.resumed_from = ckpt.path

    def _best_on_disk(self) -> float:
        """The validation loss recorded by this run's complete `best` checkpoint (inf if none)."""
        try:
            return float(verify_checkpoint(self.ckpt_dir / "best")["meta"]["val_loss"])
        except (CheckpointError, OSError, KeyError, TypeError, ValueError):
            return math.inf

    def _resume_source(self) -> Path | None:
        resume = self.cfg.train.resume
        if resume is None:
            return None
        if resume == "auto":  # continue this run directory if it has a checkpoint
            last = self.ckpt_dir / "last"
            recover_interrupted_swap(last)
            return last if (last / "manifest.json").is_file() else None
        return resolve_checkpoint(resume, prefer="last")

    def _trainer_state(self) -> dict[str, Any]:
        """Rank 0's trainer state; under FSDP every rank must call (the optimizer is gathered)."""
        return {
            "train_state": asdict(self.state),
            "optimizer": optimizer_state(self.model, self.optimizer),
            "sampler": self.sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def _meta(self, **extra: Any) -> dict[str, Any]:
        return {"step": self.state.step, "tokenizer": self.data.tokenizer_name, **extra}

    def save(self, name: str, with_trainer_state: bool = True, **meta: Any) -> Path:
        """Every rank calls this at the same step (FSDP gathers the shards); rank 0 writes, and
        the barrier holds the others until the checkpoint is complete."""
        path = self.ckpt_dir / name
        model = full_model(self.model)
        trainer_state = self._trainer_state() if with_trainer_state else None
        if self.dist.is_main:
            save_checkpoint(
                path,
                model,
                self.resolved_config,
                self._meta(**meta),
                trainer_state,
                tokenizer_file=self.data.tokenizer_file,
            )
        barrier(slow=True)  # a large checkpoint on slow storage outlasts parallel.timeout_s
        return path

    # ----- evaluation ----------------------------------------------------------------------

    def evaluate(self, whole_split: bool = False) -> EvalResult:
        return evaluate(
            self.model,
            self.data.tokens("val"),
            self.data.bytes_per_token("val"),
            self.cfg.train.batch_size,
            self.precision,
            max_batches=None if whole_split else self.cfg.train.eval_steps,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
        )

    # ----- training ------------------------------------------------------------------------

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (this rank's loss, gradient norm before clipping: the
        same on every rank). No collective and no host read but the step's health (one small
        tensor): the loss is averaged over ranks only where it is logged."""
        cfg = self.cfg
        budget = cfg.train.max_seconds  # the schedule ends by the deadline too: see lr_scale
        time_fraction = self.state.elapsed / budget if budget else 0.0
        set_lr(
            self.optimizer,
            lr_scale(self.state.step, cfg.optim, cfg.train.max_steps, time_fraction),
        )
        accum = cfg.train.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device)
        for i in range(accum):
            x, y = self.sampler.next_batch()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with gradient_sync(self.parallel_model, enabled=i == accum - 1):
                with self.precision.autocast():
                    _, loss = self.step_model(x, y, return_logits=False)  # see GPT.forward
                loss = loss / accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm(self.model, max_norm)
        verdict = self._verdict(loss_sum, grad_norm)
        if verdict != "step":
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler:  # it lowers its scale (and must be updated after unscale_)
                self.scaler.update()
            if verdict == "diverged":
                self._non_finite(loss_sum, grad_norm)
            return loss_sum, grad_norm
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

    def _verdict(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Verdict:
        """The step's verdict, the same on every rank. The gradient norm is the same everywhere
        (gradients are reduced), so only when it is not finite do the ranks agree on whether any
        rank's loss was: a collective on that rare step alone."""
        health = torch.stack([loss.isfinite(), grad_norm.isfinite()]).tolist()  # one host read
        loss_finite, grads_finite = health
        if not grads_finite:
            loss_finite = not all_reduce_max([not loss_finite], self.device)[0]
        return step_verdict(loss_finite, grads_finite, scaled=self.scaler is not None)

    def _non_finite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        what = f"loss {loss.item():.4g}, gradient norm {grad_norm.item():.4g}"
        self.state.skipped_steps += 1
        if self.cfg.train.on_nan == "skip" and self.state.skipped_steps <= MAX_SKIPPED_STEPS:
            self.progress.message(f"step {self.state.step + 1}: non-finite {what}; step skipped")
            return
        last = self.ckpt_dir / "last"
        kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was saved"
        raise TrainingError(
            f"non-finite {what} at step {self.state.step + 1}; stopping ({kept}). "
            "Try a lower optim.lr, optim.grad_clip=1.0, or train.on_nan=skip"
        )

    def run(self) -> dict[str, Any]:
        """Train to max_steps or max_seconds, then evaluate the whole validation split.
        Returns the final summary (also printed as the last line, as JSON)."""
        cfg, world = self.cfg, self.dist.world_size
        tokens_per_step = (
            cfg.train.batch_size * cfg.train.grad_accum_steps * world * self.block_size
        )
        flops_per_token = self.model.flops_per_token(self.block_size)
        peak, peak_source = peak_flops(self.precision)
        peak = peak and peak * world  # tokens/s are counted over all ranks
        self.tracker = Tracker(
            cfg.wandb,
            self.run_dir,
            self.resolved_config,
            self.state.wandb_id,
            enabled=self.dist.is_main,
        )
        self.state.wandb_id = self.tracker.run_id
        self.progress = Progress(cfg.train.max_steps, self.state.step, enabled=self.dist.is_main)
        ranks = f", {world} ranks ({cfg.parallel.strategy})" if self.dist.enabled else ""
        self.progress.message(
            f"run dir: {self.run_dir}\n"
            f"model: {self.model.num_params() / 1e6:.2f}M parameters, {self.model.config}\n"
            f"data: {self.data.meta['dataset']} ({self.data.tokenizer_name}), "
            f"{len(self.data.tokens('train')):,} train / {len(self.data.tokens('val')):,} val "
            f"tokens\ndevice: {self.device}{ranks}, {self.precision.dtype}, MFU vs {peak_source}\n"
            f"{self.tracker.location}"
        )
        if getattr(self, "resumed_from", None):
            self.progress.message(f"resumed from {self.resumed_from} at step {self.state.step}")

        exit_code = 1
        try:
            with _StopSignals() as stop:
                self._loop(stop, tokens_per_step, flops_per_token, peak)
            summary = self._finish()
            exit_code = 0
            return summary
        finally:
            self.progress.close()
            self.tracker.finish(exit_code)
            if isinstance(self.sampler, PrefetchingSampler):
                self.sampler.close()
            # The DDP wrapper holds the process group; freed after it, at exit, gloo can hang.
            self.parallel_model = self.step_model = self.model
            destroy()

    def _stop_requested(self, stop: _StopSignals, agree: bool = True) -> tuple[int, bool]:
        """(the signal received, or 0; the time budget is spent), agreed on by all ranks: a
        signal or clock on any one of them stops every rank after the same step. Under torchrun
        the ranks agree at logged steps only (`agree`), so that no other step waits on a
        collective; a single process decides at every step."""
        if self.dist.enabled and not agree:
            return 0, False
        budget = self.cfg.train.max_seconds
        late = budget is not None and self.state.elapsed >= budget
        signum, late = all_reduce_max([stop.signum or 0, late], self.device)
        return int(signum), bool(late)

    def _loop(
        self, stop: _StopSignals, tokens_per_step: int, flops_per_token: float, peak: float | None
    ) -> None:
        cfg, state = self.cfg.train, self.state
        loop_start = time.perf_counter()
        elapsed_at_start = state.elapsed
        window_start, window_steps = time.perf_counter(), 0
        first_step = state.step
        signum, out_of_time = self._stop_requested(stop)
        while state.step < cfg.max_steps and not out_of_time:
            loss, grad_norm = self.train_step()
            state.step += 1
            window_steps += 1
            state.elapsed = elapsed_at_start + time.perf_counter() - loop_start
            log_step = state.step % cfg.log_interval == 0 or state.step == cfg.max_steps
            signum, out_of_time = self._stop_requested(stop, agree=log_step)
            if state.step == first_step + 1 and not log_step:  # compiling is not training speed
                window_start, window_steps = time.perf_counter(), 0
            if log_step:
                now = time.perf_counter()
                tok_s = window_steps * tokens_per_step / (now - window_start)
                values = {
                    "loss": mean_over_ranks(loss).item(),
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "grad_norm": grad_norm.item(),
                    "tok/s": tok_s,
                }
                if peak:
                    values["mfu"] = tok_s * flops_per_token / peak
                self.losses[state.step] = values["loss"]
                self.progress.update(state.step, values, self._eta(tok_s, tokens_per_step))
                self.tracker.log(
                    {f"train/{k.replace('tok/s', 'tokens_per_s')}": v for k, v in values.items()},
                    state.step,
                )
                window_start, window_steps = now, 0
            if cfg.eval_interval and state.step % cfg.eval_interval == 0:
                self._periodic_eval()
            if cfg.ckpt_interval and state.step % cfg.ckpt_interval == 0:
                self.save("last")
            if window_steps == 0:  # tokens/s measures training: evaluations and saves excluded
                window_start = time.perf_counter()
            if signum:
                path = self.save("last")
                launcher = "torchrun <flags> train.py" if self.dist.enabled else "python train.py"
                raise TrainingInterrupted(
                    signum,
                    f"stopped by signal {signum} at step {state.step}; checkpoint saved to "
                    f"{path}. Resume with: {launcher} hydra.run.dir={self.run_dir} "
                    "train.resume=auto",
                )

    def _eta(self, tok_s: float, tokens_per_step: int) -> float:
        remaining = (self.cfg.train.max_steps - self.state.step) * tokens_per_step / tok_s
        if self.cfg.train.max_seconds is not None:
            remaining = min(remaining, self.cfg.train.max_seconds - self.state.elapsed)
        return remaining

    def _periodic_eval(self) -> EvalResult:
        result = self.evaluate()
        improved = result.loss < self.state.best_val_loss
        if improved:
            self.state.best_val_loss = result.loss
            self.save("best", with_trainer_state=False, val_loss=result.loss, val_bpb=result.bpb)
        self.progress.message(
            f"step {self.state.step} | val loss {result.loss:.4f} ± {result.stderr:.4f} "
            f"| val bpb {result.bpb:.4f}{' | best' if improved else ''}"
        )
        self.tracker.log(result.metrics("val"), self.state.step)
        # Every rank generates: under FSDP each forward is a collective. wandb.mode=disabled is
        # the one setting in which rank 0's tracker has no run.
        if self.cfg.wandb.mode != "disabled" and self.cfg.train.sample_tokens:
            self.tracker.log_samples(self._samples(), self.state.step)
        return result

    def _samples(self) -> list[tuple[str, str]]:
        """Completions of two fixed prompts (nothing, and the validation text's opening), drawn
        with their own seeded generator so that training's RNG stream is untouched."""
        eot = self.tokenizer.eot_token
        opening = [t for t in self.data.tokens("val")[:17].tolist() if t != eot][:16]
        generator = torch.Generator(self.device).manual_seed(self.cfg.seed)
        params = SamplingParams(temperature=0.8, top_k=200)
        was_training = self.model.training
        self.model.eval()
        rows = []
        for prompt in ([eot], opening):
            idx = torch.tensor([prompt], device=self.device)
            with self.precision.autocast():
                out = generate(
                    self.model,
                    idx,
                    self.cfg.train.sample_tokens,
                    params,
                    generator,
                    eot_token=eot,
                    vocab_size=self.tokenizer.n_vocab,
                )
            new = [t for t in out[0, len(prompt) :].tolist() if t != eot]
            rows.append(
                (self.tokenizer.decode([t for t in prompt if t != eot]), self.tokenizer.decode(new))
            )
        self.model.train(was_training)
        return rows

    def _finish(self) -> dict[str, Any]:
        """Always save the final state; evaluate the whole validation split."""
        if self.cfg.train.eval_interval == 0 or self.state.step % self.cfg.train.eval_interval:
            self._periodic_eval()  # the final model competes for `best` too
        last = self.save("last")
        final = self.evaluate(whole_split=True)
        summary = {
            "step": self.state.step,
            "train_seconds": round(self.state.elapsed, 2),
            "val_loss": round(final.loss, 4),
            "val_bpb": round(final.bpb, 4),
            "val_tokens": final.tokens,
            "checkpoint": str(last),
            "best_checkpoint": str(self.ckpt_dir / "best"),
        }
        self.tracker.log(final.metrics("final_val"), self.state.step)
        self.tracker.summary(summary)
        self.progress.close()
        if not self.dist.is_main:
            return summary
        print(
            f"done: {self.state.step} steps in {format_seconds(self.state.elapsed)}; whole "
            f"validation split ({final.tokens:,} tokens, non-overlapping windows of "
            f"{self.block_size}): loss {final.loss:.4f}, bpb {final.bpb:.4f}\n"
            f"checkpoint: {last} (best: {self.ckpt_dir / 'best'})\n"
            f"sample: python sample.py checkpoint={self.run_dir}"
        )
        print(json.dumps(summary))
        return summary
