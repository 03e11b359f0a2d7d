"""checkpoints/sharded.py without torchrun: any rows of a tensor split over any number of ranks'
files read back exactly (what a resume on another number of ranks reads), and an index whose
pieces do not tile the rows is refused. tests/parallel/test_sharded_checkpoints.py runs the
format under FSDP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints.sharded import Shards, merged, shard_file, write_shard


def written(directory: Path, tensor: torch.Tensor, cuts: list[int]) -> dict:
    """`tensor`'s rows written as ranks would: rank r holds rows cuts[r]:cuts[r + 1]."""
    world, entries = len(cuts) - 1, []
    for rank in range(world):
        start, stop = cuts[rank], cuts[rank + 1]
        if stop > start:  # as `split`: a rank with no rows of it writes none
            write_shard(directory, rank, world, {"t": tensor[start:stop].clone()})
            entries.append({"t": {"shape": list(tensor.shape), "rows": [[rank, start, stop]]}})
    return merged(world, entries)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    world=st.integers(1, 5),
    data=st.data(),
)
def test_any_rows_of_a_tensor_split_over_any_ranks_read_back_exactly(
    tmp_path_factory, rows, world, data
):
    directory = tmp_path_factory.mktemp("shards")
    cuts = sorted(data.draw(st.lists(st.integers(0, rows), min_size=world - 1, max_size=world - 1)))
    cuts = [0, *cuts, rows]
    tensor = torch.randn(rows, 3)
    index = written(directory, tensor, cuts)
    listed = {shard_file(r, world) for r in range(world)}
    shards = Shards(directory, index, listed)
    start = data.draw(st.integers(0, rows))
    stop = data.draw(st.integers(start, rows))
    assert torch.equal(shards.rows("t", start, stop), tensor[start:stop])


@pytest.mark.parametrize(
    "rows, error",
    [
        ([[0, 0, 4], [1, 5, 10]], "its pieces do not tile its 10 rows"),  # a gap
        ([[0, 0, 6], [1, 5, 10]], "its pieces do not tile its 10 rows"),  # an overlap
        ([[0, 0, 4], [1, 4, 9]], "its pieces do not tile its 10 rows"),  # short of the end
        ([[0, 0, 4], [2, 4, 10]], "not a shape and [[rank, start, stop], ...] rows"),  # no rank 2
        ([[0, 0, 5], [1, 5, 10]], "lacks t's rows 0:5"),  # rank 0's file holds 0:4
    ],
)
def test_an_index_that_does_not_tile_the_rows_its_files_hold_is_refused(tmp_path, rows, error):
    tensor = torch.randn(10, 3)
    written(tmp_path, tensor, [0, 4, 10])
    index = {"world_size": 2, "tensors": {"t": {"shape": [10, 3], "rows": rows}}}
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace(".", r"\.")):
        Shards(tmp_path, index, {shard_file(0, 2), shard_file(1, 2)})
