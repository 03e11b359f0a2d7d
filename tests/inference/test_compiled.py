"""Compiled decoding and low-bit weights. A compiled one-token step draws the eager tokens (greedy
and seeded sampling, across window restarts) from one graph whatever the position; it is causal
over its fixed-size cache, and a one-key-late mask fails the KV-cache check through it.
Int8Linear and Int4Linear compute their products for any shape (hypothesis); a trained model's
bits per byte stay within 1% of float32's in 8 bits, 2% in 4 (evaluate.py quantize=)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._dynamo.utils import counters

from evals.loss import evaluate_checkpoint
from hardware.device import Int4Linear, Int8Linear
from inference.cli import run
from inference.generate import (
    SamplingParams,
    StepKVCache,
    compiled_step,
    decoding_plan,
    generate,
)
from model import GPT
from model.causality import kv_cache_check
from tests.conftest import PLAYS, tiny_config

BLOCK = 16  # tiny_config's block_size
ARCHS = {
    "gpt2, manual": {},
    "llama, sdpa": dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True),
}


# A Linear layer's shapes: rows of x, widths in (past the kernels' multiples of 16 and 32) and out
LINEAR = dict(
    rows=st.integers(1, 3),
    n_in=st.integers(1, 80),
    n_out=st.integers(1, 40),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)


@pytest.fixture(autouse=True)
def fresh_compiles():
    """Each test compiles its own graphs: counted from zero, and never past dynamo's limit of 8
    graphs a function."""
    torch._dynamo.reset()
    counters.clear()


def model_for(arch: str) -> GPT:
    torch.manual_seed(0)
    attention = "sdpa" if "sdpa" in arch else "manual"
    return GPT(tiny_config(**ARCHS[arch], attention=attention)).eval()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_compiled_decoding_draws_the_eager_tokens_from_one_graph(arch, temperature):
    model = model_for(arch)
    prompt = torch.tensor([[1, 2, 3], [7, 5, 3]])
    params = SamplingParams(temperature=temperature, top_k=None)
    runs = [
        generate(model, prompt, 3 * BLOCK, params, torch.Generator().manual_seed(0), compiled=c)
        for c in (False, True)
    ]
    assert runs[0].shape == (2, 3 + 3 * BLOCK)  # past two window restarts
    assert torch.equal(runs[0], runs[1])
    assert counters["stats"]["unique_graphs"] == 1  # one graph for all 48 positions


def compiled_decoding(model: GPT):
    """The model's logits as compiled decoding computes them: several tokens eagerly, one token
    over the cache through the compiled step (a function of ids for the causality checks)."""

    def logits(idx: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is None or idx.size(1) > 1:
            return model(idx, cache=cache)[0]
        step = StepKVCache(cache)
        step.at.fill_(cache.length)
        out = compiled_step()(model, idx.clone(memory_format=torch.contiguous_format), step)
        cache.advance(1)
        return out[:, None]  # (B, 1, V)

    return logits


@pytest.mark.parametrize("arch", ARCHS)
def test_the_compiled_step_is_causal_and_a_one_key_late_mask_fails_its_check(arch):
    model = model_for(arch)
    idx = torch.randint(0, 101, (2, BLOCK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        check = kv_cache_check(compiled_decoding(model), idx, model.new_kv_cache(2))
        assert check.passed and check.largest < 1e-5
        assert counters["stats"]["unique_graphs"] == 1  # the steps did run compiled
        for block in model.transformer.h:  # each query also sees the key after it
            block.attn.causal_mask = torch.ones(BLOCK, BLOCK, dtype=torch.bool).tril(1)
        leaky = kv_cache_check(compiled_decoding(model), idx, model.new_kv_cache(2))
    assert not leaky.passed and leaky.leak is not None


def test_compile_auto_compiles_where_it_pays_and_true_is_refused_where_it_cannot():
    model = model_for("gpt2, manual")
    assert decoding_plan("auto", model, 100) == (
        False,
        "decoding: eager (compile=auto: 100 new tokens, under the 4,096 a compile pays for)",
    )
    assert decoding_plan("auto", model, 5000)[0] and decoding_plan(True, model, 1)[0]
    assert not decoding_plan(False, model, 10**6)[0]
    flash = GPT(tiny_config(attention="flash"))
    assert not decoding_plan("auto", flash, 10**6)[0]
    with pytest.raises(ValueError, match="compile=true: attention=flash decodes eagerly"):
        decoding_plan(True, flash, 1)


def test_sample_py_says_how_it_decodes_and_decodes_so(run_dir, sample_cfg, capsys):
    """The line on stderr before the tokens, and the tokens of that path: compiled gives the
    eager text."""
    texts = {}
    for flags in ("compile=false", "compile=true", "compile=true quantize=int8"):
        greedy = (f"checkpoint={run_dir}", "temperature=0", "max_new_tokens=24")
        texts[flags] = run(sample_cfg(*greedy, *flags.split()))
        texts[flags, "err"] = capsys.readouterr().err
    assert texts["compile=false", "err"] == "decoding: eager (compile=false)\n"
    assert texts["compile=true", "err"] == (
        "decoding: compiled (the first token waits for torch.compile: 1-25 s)\n"
    )
    assert texts["compile=true quantize=int8", "err"].endswith("; weights in int8\n")
    assert texts["compile=true"] == texts["compile=false"]
    assert texts["compile=true quantize=int8"][0]  # its own tokens: close ones, maybe the same


@settings(max_examples=40, deadline=None)
@given(**LINEAR)
def test_int8_linear_computes_its_8_bit_product_for_any_shape(rows, n_in, n_out, bias, seed):
    """Any input width: the kernel wants multiples of 16 (others read past the row: NaN, or a
    crash), so Int8Linear pads. The values: x in bfloat16 times each row's integers times its
    scale, within bfloat16's rounding of the product; and within 8-bit rounding of nn.Linear's."""
    torch.manual_seed(seed)
    linear = nn.Linear(n_in, n_out, bias=bias)
    x = torch.randn(rows, n_in)
    int8 = Int8Linear(linear)
    assert int8.ints.dtype == torch.int8 and int8.ints.abs().max() == 127  # each row's largest
    weights = int8.ints[:, :n_in].float() * int8.scales.float()[:, None]  # (out, in)
    product = x.bfloat16().float() @ weights.T  # before the bias: the kernel's part
    y = int8(x) - (linear.bias.detach() if bias else 0)
    assert y.shape == (rows, n_out) and y.dtype == torch.float32
    assert ((y - product).abs() <= product.abs() * 2**-7 + 1e-6).all()  # bfloat16's result
    # nn.Linear's: each weight off by at most half its row's step, x by bfloat16's rounding
    w = linear.weight.detach()
    rounding = int8.scales.float()[:, None] / 2 + w.abs() * 2**-8  # (out, in)
    bound = x.abs() @ rounding.T + product.abs() * 2**-7 + 1e-6
    assert ((y - x @ w.T).abs() <= bound).all()


@settings(max_examples=40, deadline=None)
@given(**LINEAR)
def test_int4_linear_is_within_half_a_step_of_each_weight_for_any_shape(
    rows, n_in, n_out, bias, seed
):
    """Any width (the kernel wants groups of 32 whole and outputs by 16: Int4Linear pads): each
    weight off by at most half its group's step (and its group's zero by bfloat16's rounding),
    x and y by bfloat16's."""
    torch.manual_seed(seed)
    linear = nn.Linear(n_in, n_out, bias=bias)
    x = torch.randn(rows, n_in)
    int4 = Int4Linear(linear)
    y = int4(x) - (linear.bias.detach() if bias else 0)
    assert y.shape == (rows, n_out) and y.dtype == torch.float32
    scales, zeros = int4.scales_and_zeros.float().unbind(-1)  # (in / 32, out padded) each
    per_weight = (scales / 2 + zeros.abs() * 2**-8).repeat_interleave(32, dim=0)[:n_in, :n_out]
    w = linear.weight.detach()
    product = x @ w.T
    bound = x.abs() @ (per_weight.T + w.abs() * 2**-8).T + product.abs() * 2**-7 + 1e-6
    assert ((y - product).abs() <= bound).all()
    padded = (n_out + 15) // 16 * 16 * ((n_in + 31) // 32 * 32)
    assert int4.packed.numel() * int4.packed.element_size() == padded / 2  # 4 bits a weight


def test_low_bit_weights_keep_a_trained_models_bits_per_byte_close(trained_run, tmp_path):
    """evaluate.py quantize=int8 and int4 on the run's held-out play: every Linear in 8 bits
    within 1% of float32's bits per byte, in 4 bits within 2%."""
    play = tmp_path / "play.txt"
    play.write_text((PLAYS / "roman" / "julius-caesar.md").read_text()[:8_000])
    cfg = dict(checkpoint=str(trained_run), text_file=str(play), task=None, tasks=[])
    cfg |= dict(batch_size=4, stride=None, device="cpu", dtype="float32", dataset=None)
    said = []
    full = evaluate_checkpoint(cfg, say=lambda line: None)
    int8 = evaluate_checkpoint(cfg | {"quantize": "int8"}, say=said.append)
    int4 = evaluate_checkpoint(cfg | {"quantize": "int4"}, say=said.append)
    assert said[0] == "quantize=int8: every Linear's weights in 8 bits"
    assert int8["bpb"] != full["bpb"] and abs(int8["bpb"] / full["bpb"] - 1) < 0.01
    assert int4["bpb"] != full["bpb"] and abs(int4["bpb"] / full["bpb"] - 1) < 0.02
    with pytest.raises(ValueError, match="quantize must be int8, int4, or null: .*'int3'"):
        evaluate_checkpoint(cfg | {"quantize": "int3"}, say=said.append)
