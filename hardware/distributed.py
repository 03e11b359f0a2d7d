"""Multi-process training under torchrun: the process group, DDP / FSDP2 wrapping, collectives
and full (single-process) state dicts.

`torchrun` sets RANK, LOCAL_RANK and WORLD_SIZE; without them (or with WORLD_SIZE=1) this is a
single process and every function here returns at once without touching torch.distributed, so
single-process training behaves exactly as it did before distributed training existed.

Checkpoints stay ordinary single-process checkpoints: under FSDP the weights and the optimizer
state are gathered to rank 0 in full before writing, and scattered back to shards on resume;
with parallel.checkpoint=sharded each rank writes and reads its own rows (checkpoints/sharded.py).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from base.errors import ConfigError, DataError
from data.pipeline import PreparedData
from hardware.device import is_sharded
from model import GPT

T = TypeVar("T")

# How long ranks wait for work rank 0 does alone (preparing or verifying a dataset, writing a
# checkpoint: hours for 10B tokens, minutes for gpt2-xl's 18.7 GB on network storage), where
# parallel.timeout_s (meant for a peer that died or hangs in a collective) would end the job.
# A rank that dies still ends the job at once: torchrun stops the others.
SLOW_WAIT_S = 24 * 3600
# DDP's switch for its per-forward buffer broadcast: renamed in torch 2.13 (the old name warns).
NO_BUFFER_BROADCAST = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)
_slow_group: dist.ProcessGroup | None = None  # gloo, SLOW_WAIT_S: see `barrier`


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job, from torchrun's environment variables."""

    rank: int = 0
    local_rank: int = 0  # the GPU index on this node
    world_size: int = 1
    restart: int = 0  # torchrun's restarts of the job's workers so far (--max-restarts)

    @classmethod
    def from_env(cls) -> DistInfo:
        get = os.environ.get
        ranks = int(get("RANK", 0)), int(get("LOCAL_RANK", 0)), int(get("WORLD_SIZE", 1))
        return cls(*ranks, int(get("TORCHELASTIC_RESTART_COUNT", 0)))

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints, logs to wandb and writes checkpoints."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(info: DistInfo, device: torch.device, timeout_s: float) -> torch.device:
    """Join the process group (NCCL on CUDA, gloo on CPU) and return this rank's device.

    `timeout_s` bounds every collective, so ranks blocked on a peer that died or hangs fail
    (and torchrun ends the job) instead of waiting forever."""
    if not info.enabled:
        return device
    if device.type == "mps":
        raise ConfigError("multi-process training needs CUDA or the CPU, not MPS; use device=cpu")
    if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0" and (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):  # in the store torchrun shares, a restart reads its peers' old addresses and fails
        raise ConfigError(
            "torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
            "environment, or a restarted worker cannot reach its peers (pytorch issue 135712): "
            "run TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ..."
        )
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    global _slow_group
    _slow_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=SLOW_WAIT_S))
    return device


def destroy(clean: bool = True) -> None:
    """Leave the process groups (a clean exit; torchrun warns about a group left open), and
    let go of the slow one: a gloo group still held keeps its worker threads past
    destroy_process_group, and their teardown at interpreter exit can abort a finished run
    ("terminate called without an active exception", pytorch issue 190489). After a `clean`
    run, only once every rank is past its last collective: a rank tearing gloo down while a
    peer still finishes one aborts the peer the same way. After a failure, at once: a dead
    peer would never arrive."""
    global _slow_group
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
    _slow_group = None


def barrier(slow: bool = False) -> None:
    """Wait for every rank; `slow`: for rank 0's long solo work, up to SLOW_WAIT_S (a CPU
    barrier on a gloo group of its own, whatever the main backend)."""
    if dist.is_initialized():
        dist.barrier(group=_slow_group if slow else None)


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first, the others after it is done: for work that is safe but
    wasteful to run concurrently (preparing data) or must not race (repairing a checkpoint)."""
    if not _is_main():
        barrier(slow=True)
    yield
    if _is_main():
        barrier(slow=True)


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _all_reduce(values: list[float], op: dist.ReduceOp, device: torch.device) -> list[float]:
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op)
    return t.tolist()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sums over ranks (one collective for the whole list)."""
    return _all_reduce(values, dist.ReduceOp.SUM, device)


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maxima over ranks: a flag raised on any rank is raised on all."""
    return _all_reduce(values, dist.ReduceOp.MAX, device)


def from_main(value: T, slow: bool = False) -> T:
    """Rank 0's value on every rank: for what each rank could otherwise derive differently (a
    run directory named after the second each rank started in). `slow`: the others wait as long
    as rank 0 needs to reach it (SLOW_WAIT_S)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_slow_group if slow else None)
    return box[0]


def gathered(value: T) -> list[T]:
    """Every rank's value, in rank order, on every rank; waiting up to SLOW_WAIT_S (for ranks
    still writing their part of a checkpoint)."""
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=_slow_group)
    return values


def run_on_main(fn: Callable[[], T]) -> T:
    """fn() run by rank 0 alone, its result on every rank: for work whose answer is the same
    everywhere and costly to repeat (verifying every byte of a token file on every rank). The
    others wait as long as rank 0 needs (SLOW_WAIT_S)."""
    return from_main(fn() if _is_main() else None, slow=True)


def check_visible(data: PreparedData) -> None:
    """Rank 0 verified the token files (`run_on_main`); the others only check that they see the
    same preparation (its meta.json), which needs the data cache on a filesystem every node
    shares, as the run directory does."""
    if _is_main():
        return
    meta_file = data.dir / "meta.json"
    with contextlib.suppress(OSError, ValueError):  # missing or torn: not the same
        if json.loads(meta_file.read_text()) == data.meta:
            return
    raise DataError(
        f"rank {dist.get_rank()} does not see the prepared data rank 0 verified "
        f"({meta_file}); put the data cache (CAUSALGPT_CACHE) on a filesystem all nodes share"
    )


def in_lockstep(items: Iterable[T], filler: T, device: torch.device) -> Iterator[tuple[T, bool]]:
    """(item, True) for each of this rank's items, then (filler, False) until every rank has
    run out: the same number of iterations everywhere, for loops whose body is a collective
    (an FSDP forward). One scalar all-reduce per iteration; none in a single process."""
    for item in items:
        all_reduce_max([1], device)
        yield item, True
    while all_reduce_max([0], device)[0]:
        yield filler, False


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over ranks, in place: every rank then decides on the same value."""
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t


def wrap_model(
    model: GPT,
    strategy: str,
    info: DistInfo,
    device: torch.device,
    compute_dtype: torch.dtype = torch.float32,
    compile: bool = False,
) -> nn.Module:
    """The module that training steps run forward and backward through.

    ddp: a DistributedDataParallel wrapper (`model` stays the plain replica, for evaluation and
    checkpoints). The model has no buffers that training changes (the causal masks are
    constants), so they are not broadcast before every forward; gradients live in DDP's
    communication buckets (no copy in and out). fsdp: FSDP2 shards each block, then the rest,
    in place: `model` itself becomes the sharded module, its parameters DTensors; build the
    optimizer after this. With a bfloat16/float16 `compute_dtype` the parameters are gathered in
    it (half the all-gather traffic) and gradients reduced in float32 (torchtitan's default).
    compile: the whole (DDP-wrapped) model compiled, as nanoGPT does; under FSDP each block in
    place (torchtitan's way: the all-gathers between blocks stay outside the graphs, which FSDP2
    hooks drive)."""
    if not info.enabled or strategy == "ddp":
        wrapped = model
        if info.enabled:
            wrapped = DistributedDataParallel(
                model,
                device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True,
                **NO_BUFFER_BROADCAST,
            )
        return torch.compile(wrapped) if compile else wrapped
    from torch.distributed import fsdp  # here: importing it costs every script ~1 s of start

    mp_policy = fsdp.MixedPrecisionPolicy()  # float32: no casts
    if compute_dtype != torch.float32:
        mp_policy = fsdp.MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fsdp.fully_shard(block, mp_policy=mp_policy)
    fsdp.fully_shard(model, mp_policy=mp_policy)
    if compile:
        for block in model.transformer.h:
            block.compile()
    return model


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Gradient accumulation without needless communication: the forward and backward of every
    micro-batch but the last accumulate locally (enabled=False); the last one reduces. `model`:
    what wrap_model returned (a compiled module's wrapper is its `_orig_mod`)."""
    model = getattr(model, "_orig_mod", model)
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(enabled)
    if isinstance(model, DistributedDataParallel) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The total gradient norm before clipping, as a plain tensor (FSDP returns a replicated
    DTensor, computed over all shards)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor: FSDP


def full_model(model: GPT) -> GPT:
    """A GPT whose state_dict is the full set of weights, for `save_checkpoint` on rank 0.

    Unsharded models are returned as they are. Sharded (FSDP) ones are gathered to rank 0's CPU
    (every rank must call this) and placed in a GPT built on the meta device, which allocates
    nothing and is never run; on other ranks it holds no weights."""
    if not is_sharded(model):
        return model
    from torch.distributed.checkpoint import state_dict as dcp_state  # FSDP only

    options = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = dcp_state.get_model_state_dict(model, options=options)
    with torch.device("meta"):
        holder = GPT(model.config)
    if state:
        holder.load_state_dict(state, assign=True)
    return holder


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the order `optimizer.state_dict()` numbers them."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _rekey(state: dict[str, Any], key: dict[Any, Any]) -> dict[str, Any]:
    groups = [{**g, "params": [key[p] for p in g["params"]]} for g in state["param_groups"]]
    return {"state": {key[k]: v for k, v in state["state"].items()}, "param_groups": groups}


def optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, gather: bool = True
) -> dict[str, Any]:
    """`optimizer.state_dict()`, in full: under FSDP gathered from the shards to rank 0's CPU
    (every rank must call; other ranks get an empty dict) and numbered like a single process's,
    so any world size, or a single process, can resume from it. gather=False (a sharded
    checkpoint's): keyed by parameter name, this rank's shards as they are (DTensors)."""
    if not gather:
        if is_sharded(model):  # an evaluation's forward leaves the root's weights unsharded
            model.reshard()  # (FSDP2's root keeps them for a backward): its parameters again
        return _rekey(optimizer.state_dict(), dict(enumerate(_param_names(model, optimizer))))
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint import state_dict as dcp_state  # FSDP only

    options = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = dcp_state.get_optimizer_state_dict(model, optimizer, options=options)
    number = {name: i for i, name in enumerate(_param_names(model, optimizer))}
    return _rekey(state, number) if state else {}


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """The inverse of `optimizer_state`: under FSDP every rank keeps its shard of the state.

    The state (moments, momentum buffers, step counts) comes from the checkpoint; the groups'
    hyperparameters (peak rates, betas, weight decay...) are this run's config's, which a
    resume cannot change (trainer/config.py's RESUMABLE holds no optim key): the checkpoint's."""
    saved = [len(g["params"]) for g in state["param_groups"]]
    ours = [len(g["params"]) for g in optimizer.param_groups]
    if saved != ours:
        raise ConfigError(
            f"the checkpoint's optimizer has parameter groups of {saved} parameters, this run's "
            f"has {ours}: resume with the optim.name the checkpoint was trained with"
        )
    configured = [dict(g) for g in optimizer.param_groups]  # loading keeps each group's params
    names = _param_names(model, optimizer)
    if isinstance(state["param_groups"][0]["params"][0], str):  # by name: a sharded checkpoint's
        optimizer.load_state_dict(_placed(model, state, {name: i for i, name in enumerate(names)}))
    elif not is_sharded(model):
        optimizer.load_state_dict(state)
    else:
        by_name = _rekey(state, dict(enumerate(names)))
        from torch.distributed.checkpoint import state_dict as dcp_state  # FSDP only

        options = dcp_state.StateDictOptions(full_state_dict=True)
        dcp_state.set_optimizer_state_dict(model, optimizer, by_name, options=options)
    for group, values in zip(optimizer.param_groups, configured, strict=True):
        group.update(values)


def _placed(model: nn.Module, state: dict[str, Any], number: dict[str, int]) -> dict[str, Any]:
    """A sharded checkpoint's optimizer state (keyed by parameter name), each moment read as its
    parameter is placed (checkpoints/sharded.py's ShardedTensor.placed: under FSDP this rank's
    rows alone), numbered as `optimizer.state_dict()` numbers the parameters."""
    params = dict(model.named_parameters())
    placed = {
        name: {k: v.placed(params[name]) if hasattr(v, "placed") else v for k, v in s.items()}
        for name, s in state["state"].items()
    }  # a step count is a plain tensor
    return _rekey({**state, "state": placed}, number)
