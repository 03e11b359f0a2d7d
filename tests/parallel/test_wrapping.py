"""DDP and FSDP2 options, checked in-process on a one-rank gloo group (no torchrun needed)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from evals.tasks import load_task, score_task
from hardware import distributed
from hardware.device import decodes_from_a_copy
from hardware.distributed import DistInfo, barrier, run_on_main, wrap_model
from inference import SamplingParams, generate
from model import GPT
from tests.conftest import CPU, GPT2, local_task, model_for, tiny_config

TWO_RANKS = DistInfo(rank=0, local_rank=0, world_size=2)  # `enabled`: wrap as under torchrun


@pytest.fixture
def group(monkeypatch):
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    monkeypatch.setattr(distributed, "_slow_group", dist.new_group(backend="gloo"))
    yield
    dist.destroy_process_group()


def test_ddp_broadcasts_no_buffers_and_keeps_gradients_in_its_buckets(group):
    model = GPT(tiny_config())
    ddp = wrap_model(model, "ddp", TWO_RANKS, torch.device("cpu"))
    assert isinstance(ddp, DistributedDataParallel)
    assert ddp.require_forward_param_sync and not ddp.will_sync_module_buffers()
    assert ddp.gradient_as_bucket_view is True
    assert DistributedDataParallel(GPT(tiny_config())).will_sync_module_buffers()  # the default
    _, loss = ddp(torch.randint(0, 101, (2, 16)), torch.randint(0, 101, (2, 16)))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fsdp_gathers_parameters_in_the_compute_dtype_and_reduces_in_float32(group, dtype):
    model = wrap_model(GPT(tiny_config()), "fsdp", TWO_RANKS, torch.device("cpu"), dtype)
    for module in (*model.transformer.h, model):
        policy = module._get_fsdp_state()._mp_policy
        expected = None if dtype == torch.float32 else dtype
        assert policy.param_dtype == expected
        assert policy.reduce_dtype == (None if dtype == torch.float32 else torch.float32)


def test_an_fsdp_model_generates_from_itself_the_plain_models_tokens(group):
    torch.manual_seed(0)
    plain = GPT(tiny_config()).eval()
    model = wrap_model(copy.deepcopy(plain), "fsdp", TWO_RANKS, torch.device("cpu"))
    assert decodes_from_a_copy(plain) and not decodes_from_a_copy(model)  # shards: no copy
    prompt, greedy = torch.tensor([[1, 2, 3]]), SamplingParams(temperature=0)
    assert torch.equal(generate(model, prompt, 20, greedy), generate(plain, prompt, 20, greedy))


def test_an_fsdp_model_scores_a_task_as_the_plain_model(group, tmp_path):
    """Task scoring runs forward over a KV cache, the prefix's last position alone then the rest."""
    model = model_for()
    sharded = wrap_model(copy.deepcopy(model), "fsdp", TWO_RANKS, torch.device("cpu"))
    task = load_task(local_task(tmp_path, "hellaswag"), GPT2, 64)
    assert score_task(sharded, task, CPU) == score_task(model, task, CPU)


def test_fsdp_compiles_each_block_not_the_sharded_whole(group, monkeypatch):
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: compiled.append(self))
    model = GPT(tiny_config())
    assert wrap_model(model, "fsdp", TWO_RANKS, torch.device("cpu"), compile=True) is model
    assert compiled == list(model.transformer.h)


def test_rank_0_runs_the_work_and_the_slow_barrier_passes(group):
    calls = []
    assert run_on_main(lambda: calls.append(1) or "verified") == "verified"
    assert calls == [1]
    barrier(slow=True)
