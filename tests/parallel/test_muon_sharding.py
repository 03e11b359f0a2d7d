"""Muon under DDP deals its Newton-Schulz work over the ranks, a shape at a time, and still
applies, on every rank, exactly the single-process update (2 gloo ranks, spawned in-process)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer import optim
from trainer.optim import Muon


def _run(params_file: str, world: int, rank: int = 0, store_file: str | None = None) -> int:
    """Three Muon steps on fixed matrices and gradients; returns the Newton-Schulz calls made."""
    if store_file is not None:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_file}", rank=rank, world_size=world
        )
    calls = []
    ns = optim.zeropower_via_newtonschulz5
    optim.zeropower_via_newtonschulz5 = lambda g, steps: calls.append(1) or ns(g, steps)
    torch.manual_seed(0)
    # tall ones are returned transposed; the two (6, 4) are orthogonalized together, one call
    shapes = [(6, 4), (4, 6), (5, 5), (8, 3), (3, 3), (6, 4)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = Muon([dict(params=params, use_muon=True, lr=0.02, momentum=0.95, nesterov=True,
                     ns_steps=5, weight_decay=0.01)])  # fmt: skip
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)  # the same on every rank, as after DDP's all-reduce
        opt.step()
    torch.save([p.detach() for p in params], params_file)
    if store_file is not None:  # both ranks past their last collective before either leaves
        dist.barrier()  # (a rank tearing gloo down mid-collective aborted once, under load)
        dist.destroy_process_group()
    return len(calls)


def _rank(rank: int, world: int, tmp: str) -> None:
    calls = _run(f"{tmp}/params{rank}.pt", world, rank, f"{tmp}/store")
    torch.save(calls, f"{tmp}/calls{rank}.pt")


def test_each_rank_orthogonalizes_its_share_and_all_apply_the_single_process_update(tmp_path):
    assert _run(str(tmp_path / "single.pt"), world=1) == 15  # 5 shapes x 3 steps
    mp.spawn(_rank, args=(2, str(tmp_path)), nprocs=2, join=True)
    assert torch.load(tmp_path / "calls0.pt") == 9  # shapes 0, 2, 4: (6, 4), (5, 5), (3, 3)
    assert torch.load(tmp_path / "calls1.pt") == 6  # shapes 1, 3: (4, 6), (8, 3)
    single = torch.load(tmp_path / "single.pt")
    for rank in (0, 1):
        for a, b in zip(torch.load(tmp_path / f"params{rank}.pt"), single, strict=True):
            assert torch.equal(a, b)
