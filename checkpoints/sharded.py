"""Sharded checkpoints (parallel.checkpoint=sharded): every rank writes its own rows of the
weights and of the optimizer state, all ranks at once, and no process gathers the whole state.

Under FSDP each parameter and each Adam moment is a DTensor: every rank holds a block of its
rows (dim 0, split as torch.chunk splits). A whole checkpoint (the default) first gathers them
to rank 0's CPU, three times the weights in one process, which one process then writes. A
sharded checkpoint's directory holds, beside config.json, trainer.pt, tokenizer.json and
manifest.json (checkpoints/store.py):

    shard-<rank>-of-<W>.safetensors  that rank's rows of every sharded tensor; rank 0's also
                                     holds the tensors no rank shards (one process's, DDP's)
    shards.json                      {"world_size": W, "tensors": {name: {"shape": [...],
                                     "rows": [[rank, start, stop], ...]}}}

A name is "model/<parameter>" for a weight, "optimizer/state/<parameter>/<moment>" for an
optimizer tensor (Adam's exp_avg and exp_avg_sq), which trainer.pt holds as {"shard": name}. A
reader checks shards.json against every shard's safetensors header before it reads a byte, then
reads any rows of any tensor: the weights whole (sample.py, evaluate.py, export.py, a resumed
run's model), a rank's own rows of each moment (a resume on any number of ranks:
hardware/distributed.py's `load_optimizer_state`).

torch.distributed.checkpoint's format is not used: its metadata file is a pickle, and loading a
checkpoint here never runs code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def shard_file(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh")  # without importing torch.distributed.tensor


def row_range(t: torch.Tensor) -> tuple[int, int]:
    """The rows of `t` this process holds: all of a plain tensor's; of a DTensor sharded on dim
    0 (FSDP2's placement), its rank's block of them, as torch.chunk splits them."""
    rows = t.shape[0]
    if not is_dtensor(t):
        return 0, rows
    chunk = -(-rows // t.device_mesh.size())
    start = min(t.device_mesh.get_local_rank() * chunk, rows)
    stop = min(start + chunk, rows)
    if str(t.placements) != "(Shard(dim=0),)" or t.to_local().shape[0] != stop - start:
        raise ValueError(f"a DTensor placed as {t.placements} is not FSDP's row shards")
    return start, stop


def split(
    trees: dict[str, Any], rank: int, world_size: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(this rank's rows to write, by name; their shards.json entries; `trees` with each tensor
    replaced by {"shard": name}). Every tensor but a scalar goes to the shards: each rank writes
    its rows of a DTensor, rank 0 alone a tensor no rank shards."""
    mine: dict[str, torch.Tensor] = {}
    entries: dict[str, Any] = {}

    def walk(tree: Any, name: str) -> Any:
        if isinstance(tree, torch.Tensor) and tree.dim() > 0:
            start, stop = row_range(tree)
            if stop > start and (rank == 0 or is_dtensor(tree)):
                local = tree.to_local() if is_dtensor(tree) else tree
                mine[name] = local.detach().cpu().contiguous()
                entries[name] = {"shape": list(tree.shape), "rows": [[rank, start, stop]]}
            return {"shard": name}
        if isinstance(tree, dict):
            return {k: walk(v, f"{name}/{k}") for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(walk(v, f"{name}/{i}") for i, v in enumerate(tree))
        return tree

    return mine, entries, {key: walk(tree, key) for key, tree in trees.items()}


def write_shard(directory: Path, rank: int, world_size: int, tensors: dict[str, torch.Tensor]):
    """This rank's file in `directory` (none when it holds no rows); its name, or None."""
    if not tensors:
        return None
    name = shard_file(rank, world_size)
    save_file(tensors, str(directory / name))
    return name


def merged(world_size: int, all_entries: list[dict[str, Any]]) -> dict[str, Any]:
    """shards.json's content from every rank's entries (`split`)."""
    tensors: dict[str, Any] = {}
    for entries in all_entries:
        for name, entry in entries.items():
            tensors.setdefault(name, {"shape": entry["shape"], "rows": []})["rows"] += entry["rows"]
    return {"world_size": world_size, "tensors": tensors}


@dataclass(frozen=True)
class ShardedTensor:
    """One tensor of a sharded checkpoint, read by rows."""

    shards: Shards
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.shards.shapes[self.name]

    def rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.shards.rows(self.name, start, self.shape[0] if stop is None else stop)

    def placed(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor as `param` is placed: whole beside a plain tensor; beside a DTensor (FSDP,
        on any number of ranks) this rank's rows alone, read and sharded as it is."""
        if not is_dtensor(param):
            return self.rows()
        from torch.distributed.tensor import DTensor  # FSDP only

        rows = self.rows(*row_range(param)).to(param.device)
        return DTensor.from_local(
            rows, param.device_mesh, param.placements, run_check=False,
            shape=param.shape, stride=param.stride(),
        )  # fmt: skip


class Shards:
    """A sharded checkpoint's tensors. Every claim of shards.json is checked against the shard
    files' headers on construction (a ValueError says which): each tensor's pieces tile its rows
    exactly, each piece is in its file with its rows' shape, all pieces of a tensor share a
    dtype. So a read allocates no more than the files hold, and reads what was written."""

    def __init__(self, directory: Path, index: dict[str, Any], listed: set[str]):
        self.directory = directory
        self.world_size, tensors = index.get("world_size"), index.get("tensors")
        if type(self.world_size) is not int or self.world_size < 1 or type(tensors) is not dict:
            raise ValueError('not {"world_size": <ranks>, "tensors": {...}}')
        headers: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
        self.pieces: dict[str, list[tuple[int, int, int]]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for name, entry in tensors.items():
            shape, pieces = self._entry(name, entry)
            dtypes = set()
            for rank, start, stop in pieces:
                file = shard_file(rank, self.world_size)
                if rank not in headers:
                    headers[rank] = self._header(file, listed)
                dtype, piece_shape = headers[rank].get(name, ("", ()))
                if piece_shape != (stop - start, *shape[1:]):
                    raise ValueError(f"{file} lacks {name}'s rows {start}:{stop}")
                dtypes.add(dtype)
            if len(dtypes) != 1:
                raise ValueError(f"{name}'s pieces have different dtypes {sorted(dtypes)}")
            self.pieces[name], self.shapes[name], self.dtypes[name] = pieces, shape, dtypes.pop()

    def _entry(self, name: str, entry: Any) -> tuple[tuple[int, ...], list[tuple[int, int, int]]]:
        """A tensor's shape and its pieces, sorted, checked to tile its rows."""
        rows = entry.get("rows") if isinstance(entry, dict) else None
        shape = _naturals(entry.get("shape")) if isinstance(entry, dict) else None
        pieces = sorted(_naturals(r) or (-1,) for r in rows) if isinstance(rows, list) else []
        if not shape or not pieces or any(len(p) != 3 or p[0] >= self.world_size for p in pieces):
            raise ValueError(f"{name}: not a shape and [[rank, start, stop], ...] rows")
        ends = [0, *(stop for _, _, stop in pieces)]
        if [start for _, start, _ in pieces] != ends[:-1] or ends[-1] != shape[0]:
            raise ValueError(f"{name}: its pieces do not tile its {shape[0]} rows")
        return shape, pieces  # type: ignore[return-value]

    def _header(self, file: str, listed: set[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
        if file not in listed:  # verified files only (checkpoints/store.py's manifest)
            raise ValueError(f"names {file}, which the checkpoint's manifest does not list")
        with safe_open(str(self.directory / file), "pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 - not a dict
            return {k: (s.get_dtype(), tuple(s.get_shape())) for k, s in slices.items()}

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of the tensor `name`, from the pieces that hold them."""
        pieces = self.pieces[name]
        wanted = [
            (rank, max(a, start) - a, min(b, stop) - a)
            for rank, a, b in pieces
            if max(a, start) < min(b, stop)
        ]
        parts = []
        for rank, low, high in wanted or [(pieces[0][0], 0, 0)]:  # none: 0 rows, as its dtype
            with safe_open(str(self.directory / shard_file(rank, self.world_size)), "pt") as f:
                parts.append(f.get_slice(name)[low:high])
        return torch.cat(parts)

    def tree(self, tree: Any) -> Any:
        """`tree` (trainer.pt's) with each {"shard": name} a ShardedTensor; a name shards.json
        lacks is a ValueError."""
        if isinstance(tree, dict) and tree.keys() == {"shard"}:
            if tree["shard"] not in self.shapes:
                raise ValueError(f"names the shard {tree['shard']!r}, which shards.json lacks")
            return ShardedTensor(self, tree["shard"])
        if isinstance(tree, dict):
            return {k: self.tree(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self.tree(v) for v in tree)
        return tree


def _naturals(value: Any) -> tuple[int, ...] | None:
    """A JSON list of non-negative integers as a tuple, else None."""
    ok = isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)
    return tuple(value) if ok else None
