"""The model's matrices laid out for decoding on a CPU: every matrix-vector product on every core.

Decoding one token at batch 1 multiplies one vector by every weight matrix, so its speed is how
fast the weights stream from memory. MKL, torch's CPU BLAS, runs such a product on one core, and
from nn.Linear's (out, in) layout at a fraction of the bandwidth: on a 2-core AMD EPYC (Zen 3)
8-9 GB/s for GPT-2's head against 18-21 GB/s from an (in, out) copy, and ~27 GB/s with the copy
cut into two column blocks that `torch.bmm` hands to the two cores (benchmarks/bench_sample.py
prints these figures on any machine). `decoding_copy` gives generation a copy of the model whose
Linear layers are `SplitLinear`s: the same values in that layout, the model's code unchanged.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class SplitLinear(nn.Module):
    """nn.Linear's y = x W^T + b, with W copied into `parts` column blocks side by side, each in
    (in, out) layout: blocks (parts, in, width), the last block padded with zero columns. One
    torch.bmm multiplies the input by every block, and the blocks' outputs side by side are y.
    Inference only: the blocks are a detached copy, taken when the copy is made."""

    def __init__(self, linear: nn.Linear, parts: int):
        super().__init__()
        weight = linear.weight.detach()  # (out, in)
        self.out_features, in_features = weight.shape
        width = -(-self.out_features // parts)  # output columns per block, rounded up
        padded = weight.new_zeros(parts * width, in_features)  # (parts * width, in)
        padded[: self.out_features] = weight
        blocks = padded.view(parts, width, in_features).transpose(1, 2).contiguous()
        self.register_buffer("blocks", blocks, persistent=False)  # (parts, in, width)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)  # (out,) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        lead = x.shape[:-1]
        rows = x.reshape(1, -1, x.size(-1)).expand(self.blocks.size(0), -1, -1)  # (parts, n, in)
        y = torch.bmm(rows, self.blocks)  # (parts, n, width)
        y = y.transpose(0, 1).reshape(*lead, -1)[..., : self.out_features]  # (..., out)
        return y if self.bias is None else y + self.bias


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP shards the model's weights (DTensors, gathered by its forward's hooks)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def decodes_from_a_copy(model: nn.Module) -> bool:
    """Whether generation decodes from `decoding_copy(model)`: for float32 weights on a CPU, held
    whole by this process. GPUs read nn.Linear's layout at full speed (no memory is spent on a
    copy)."""
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not is_sharded(model)


def decoding_copy(model: nn.Module, parts: int | None = None) -> nn.Module:
    """A copy of `model` whose nn.Linear layers are SplitLinear (`parts` blocks each; default:
    torch's CPU thread count). Everything else is shared with `model`, not copied: the extra
    memory is one copy of the Linear weights, the head's included. Take a new copy after the
    weights change."""
    parts = parts or torch.get_num_threads()
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    decoder = copy.deepcopy(model, memo=shared)
    for module in list(decoder.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                setattr(module, name, SplitLinear(child, parts))
    return decoder
