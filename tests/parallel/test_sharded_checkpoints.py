"""parallel.checkpoint=sharded (checkpoints/sharded.py) under torchrun with FSDP on 2 gloo ranks:
each rank writes its own rows; the checkpoint holds the same numbers as the whole one gathered
from the same run; a resume on 2 ranks and on 1 process continues bit for bit; sample.py reads
it whole; a missing, corrupt or lying shard is one clear error."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from checkpoints.sharded import ShardedTensor
from checkpoints.store import SHARDS_FILE, CheckpointError, load_checkpoint, manifest_entry
from tests.conftest import make_trainer, run_script
from tests.parallel.test_torchrun import RUN, WORKER, torchrun

pytestmark = pytest.mark.slow

FSDP = [*RUN, "parallel.strategy=fsdp", "train.keep_checkpoints=2"]  # step-2 kept


def fsdp_run(tmp: Path, corpus: list[str], checkpoint: str, *extra: str) -> Path:
    run = tmp / "run"
    args = [*FSDP, *corpus, f"parallel.checkpoint={checkpoint}", *extra]
    result = torchrun(WORKER, str(run), *args, cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, corpus) -> Path:
    return fsdp_run(tmp_path_factory.mktemp("sharded"), corpus, "sharded")


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, corpus) -> Path:
    return fsdp_run(tmp_path_factory.mktemp("whole"), corpus, "whole")


def step_2(run: Path) -> Path:
    return run / "checkpoints" / "step-2"


def moments(ckpt, names: list[str]) -> dict[str, torch.Tensor]:
    """Every optimizer tensor of a checkpoint, read whole, by parameter name: a sharded
    checkpoint's own keys, a whole one's numbers (hardware/distributed.py) as `names`."""
    state = ckpt.trainer_state["optimizer"]["state"]
    return {
        f"{name if isinstance(name, str) else names[name]}/{key}": (
            value.rows() if isinstance(value, ShardedTensor) else value
        )
        for name, s in state.items()
        for key, value in s.items()
    }


def test_each_rank_writes_its_rows_and_they_are_the_whole_checkpoints_numbers(
    sharded_run, whole_run
):
    files = sorted(p.name for p in step_2(sharded_run).iterdir())
    assert files == [
        "config.json", "manifest.json", "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors", "shards.json", "trainer.pt",
    ]  # fmt: skip
    index = json.loads((step_2(sharded_run) / SHARDS_FILE).read_text())
    wte = index["tensors"]["model/transformer.wte.weight"]
    assert wte["rows"] == [[0, 0, 25129], [1, 25129, 50257]]  # torch.chunk's uneven split
    for step in (step_2, lambda run: run / "checkpoints" / "last"):
        ours = load_checkpoint(step(sharded_run), with_trainer_state=True)
        theirs = load_checkpoint(step(whole_run), with_trainer_state=True)
        for name, tensor in theirs.model.state_dict().items():
            assert torch.equal(ours.model.state_dict()[name], tensor), name
        groups = ours.trainer_state["optimizer"]["param_groups"]
        names = [name for group in groups for name in group["params"]]
        ours_moments, their_moments = moments(ours, names), moments(theirs, names)
        assert ours_moments.keys() == their_moments.keys() and len(ours_moments) > 30
        for name, tensor in their_moments.items():
            assert torch.equal(ours_moments[name], tensor), name


def test_a_rank_killed_writing_its_shard_leaves_the_last_checkpoint_and_the_resume_is_exact(
    sharded_run, tmp_path, corpus
):
    """Rank 1 SIGKILLed inside its third shard write (step 2's best and last, then step 4's
    first): the job ends, `last` is step 2's, whole, and a resume on 2 ranks ends with the
    uninterrupted run's weights, bit for bit."""
    run, args = tmp_path / "run", [*FSDP, *corpus, "parallel.checkpoint=sharded"]
    killed = torchrun(
        WORKER, str(run), *args, "--fault=checkpoint.partial:3", "--fault-rank=1", cwd=tmp_path
    )
    assert killed.returncode != 0 and "fault: SIGKILL at checkpoint.partial" in killed.stderr
    assert load_checkpoint(run / "checkpoints" / "last").meta["step"] == 2
    result = torchrun(WORKER, str(run), *args, "train.resume=auto", cwd=tmp_path)
    assert result.returncode == 0 and "at step 2" in result.stdout, result.stderr[-3000:]
    straight = load_checkpoint(sharded_run / "checkpoints" / "last").model.state_dict()
    for name, tensor in load_checkpoint(run / "checkpoints" / "last").model.state_dict().items():
        assert torch.equal(tensor, straight[name]), name


def test_a_resume_in_one_process_continues_as_from_the_whole_checkpoint(
    sharded_run, whole_run, tmp_path, corpus
):
    """The same run's step 2, sharded by 2 ranks or gathered whole, resumed by one process:
    the same steps 3 and 4, bit for bit (and one process saves it sharded too: rank 0 alone)."""
    finals = []
    for checkpoint, run in (("sharded", sharded_run), ("whole", whole_run)):
        resumed = make_trainer(
            tmp_path / checkpoint, corpus, *FSDP,
            f"parallel.checkpoint={checkpoint}", f"train.resume={step_2(run)}",
        )  # fmt: skip
        assert resumed.state.step == 2
        resumed.run()
        finals.append(resumed.model.state_dict())
    for name, tensor in finals[1].items():
        assert torch.equal(finals[0][name], tensor), name
    one_process = load_checkpoint(tmp_path / "sharded" / "checkpoints" / "last")
    for name, tensor in finals[0].items():
        assert torch.equal(one_process.model.state_dict()[name], tensor), name


def test_sample_py_reads_a_sharded_checkpoint_whole_and_says_what_it_takes(sharded_run, tmp_path):
    result = run_script(
        "sample.py", f"checkpoint={sharded_run}", "max_new_tokens=4", "prompt=The", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "-way sharded" not in result.stdout
    line = f"{sharded_run / 'checkpoints' / 'best'}: reading its 2-way sharded weights whole"
    assert line in result.stderr and " MiB" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "damage, error",
    [
        ("missing", "shard-00001-of-00002.safetensors is missing"),
        ("corrupt", "shard-00001-of-00002.safetensors fails its sha256 check"),
        ("unlisted", "shard-00001-of-00002.safetensors is not listed in"),
        ("lying", "shards.json is corrupt: model/transformer.wte.weight: its pieces do not tile"),
        ("renamed", "trainer.pt names the shard 'optimizer/state/x/exp_avg', which shards.json"),
    ],
)
def test_a_missing_corrupt_or_lying_shard_is_one_clear_error(sharded_run, tmp_path, damage, error):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(step_2(sharded_run), ckpt)
    shard, manifest_file = ckpt / "shard-00001-of-00002.safetensors", ckpt / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    if damage == "missing":
        shard.unlink()
    elif damage == "corrupt":
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
    elif damage == "unlisted":
        del manifest[shard.name]
    elif damage == "lying":  # rank 1's rows claimed to start one row late, manifest updated
        index = json.loads((ckpt / SHARDS_FILE).read_text())
        index["tensors"]["model/transformer.wte.weight"]["rows"][1][1] += 1
        (ckpt / SHARDS_FILE).write_text(json.dumps(index))
        manifest[SHARDS_FILE] = manifest_entry(ckpt / SHARDS_FILE)
    else:  # renamed: trainer.pt, its manifest entry updated, names a moment shards.json lacks
        state = torch.load(ckpt / "trainer.pt", weights_only=True)
        moments = state["optimizer"]["state"]["transformer.wte.weight"]
        moments["exp_avg"] = {"shard": "optimizer/state/x/exp_avg"}
        torch.save(state, ckpt / "trainer.pt")
        manifest["trainer.pt"] = manifest_entry(ckpt / "trainer.pt")
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=re.escape(error)):
        load_checkpoint(ckpt, with_trainer_state=True)
