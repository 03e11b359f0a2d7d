"""attention=triton: the Triton kernel computes the manual formula's outputs and gradients.

On a CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
with 16 x 16 tiles, so these small shapes cross several tiles, the diagonal and a ragged end.
What only a GPU shows (compiled kernels, the GPU tile sizes, speed) is checked by
scripts/gpu_check.sh on a lent GPU (docs/performance.md).
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("triton", reason="attention=triton needs the triton package (Linux only)")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402, F401  (jit functions need it in their module)

from base.errors import ConfigError  # noqa: E402
from model import GPT  # noqa: E402
from model import triton_attention as kernel  # noqa: E402
from model.causality import CausalityError, assert_causal  # noqa: E402
from model.gpt import causal_attention  # noqa: E402
from model.triton_attention import triton_causal_attention  # noqa: E402
from tests.conftest import run_script, tiny_config  # noqa: E402
from tests.model.conftest import (
    assert_gives_manuals_logits_and_gradients,  # noqa: E402
    find_leaks,  # noqa: E402
)

TILE = 16  # the interpreter's tiles (model/triton_attention.tilings)
ALL_VARIANTS = tuple(kernel.VARIANTS)  # issue 61's, together


def _qkv(B: int, H: int, T: int, hs: int, dtype=torch.float32):
    return [torch.randn(B, H, T, hs, dtype=dtype, requires_grad=True) for _ in "qkv"]


def _manual(q, k, v):
    T = q.size(2)
    return causal_attention(q, k, v, torch.ones(T, T, dtype=torch.bool).tril())


def _outputs_and_grads(attend, q, k, v, grad_out):
    out = attend(q, k, v)
    return [out, *torch.autograd.grad(out, (q, k, v), grad_out)]


@pytest.mark.parametrize(
    "B,H,T,hs",
    [
        (1, 1, 1, 16),  # T = 1: one query, one key
        (2, 3, 37, 16),  # T not a multiple of the tile: a ragged last tile, head size 16
        (1, 2, TILE, 32),  # T = one tile exactly
        (2, 2, 50, 8),  # head size below the 16 a tile needs: padded
        (1, 1, 33, 96),  # head size 96: padded to 128
        (1, 1, 18, 64),
        (1, 1, 20, 128),
    ],
)
def test_outputs_and_gradients_equal_manual_in_float32(B, H, T, hs):
    torch.manual_seed(0)
    q, k, v = _qkv(B, H, T, hs)
    grad_out = torch.randn(B, H, T, hs)
    got = _outputs_and_grads(triton_causal_attention, q, k, v, grad_out)
    want = _outputs_and_grads(_manual, q, k, v, grad_out)
    for name, a, b in zip(["Y", "dQ", "dK", "dV"], got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_errs_no_more_than_the_formula_in_that_precision(dtype):
    """The matmuls take P and dS rounded to the half dtype (tensor cores' inputs, as
    FlashAttention-2's), scores and sums stay float32. As FlashAttention's own tests measure it:
    against the formula in float32, the error is within a small factor of the formula's own run
    in the half dtype, which rounds at other points (S, and P after its softmax): 3 here, where
    a wrong tile or mask errs by O(1)."""
    torch.manual_seed(0)
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _qkv(2, 3, 40, 32))
    grad_out = torch.randn(2, 3, 40, 32).to(dtype)
    got = _outputs_and_grads(triton_causal_attention, q, k, v, grad_out)
    half = _outputs_and_grads(_manual, q, k, v, grad_out)
    wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
    exact = _outputs_and_grads(_manual, *wide, grad_out.float())
    assert all(t.dtype == dtype for t in got)
    for name, a, h, e in zip(["Y", "dQ", "dK", "dV"], got, half, exact, strict=True):
        error, formula_error = (a.float() - e).abs().max(), (h.float() - e).abs().max()
        assert 0 < error <= 3 * formula_error, name


def test_the_heads_of_a_fused_projection_are_read_through_their_strides():
    """The model's q, k, v are views into one (B, T, 3C) projection, not contiguous tensors."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 21, 3 * 4 * 16, requires_grad=True)
    heads = [t.view(2, 21, 4, 16).transpose(1, 2) for t in qkv.split(64, dim=2)]
    grad_out = torch.randn(2, 4, 21, 16)
    got = _outputs_and_grads(triton_causal_attention, *heads, grad_out)
    want = _outputs_and_grads(_manual, *heads, grad_out)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "size,stride",
    [  # from the view's start: head 2 at 2^31 + 2^11 elements; rows 16 and 17 at 2^31, 2^31 + 2^27
        ((1, 3, 18, 16), (2**32, 2**30 + 2**10, 48, 1)),
        ((1, 1, 18, 16), (2**32, 2**32, 2**27, 1)),
    ],
    ids=["head", "row"],
)
def test_offsets_past_2_to_the_31_elements_do_not_wrap(size, stride):
    """Views whose head or row offsets pass 2^31 elements (strides below 2^31, which Triton
    passes as 32-bit integers) give the dense copies' outputs and gradients bit for bit. The
    storage is 8.5 GiB of virtual memory, of which only the pages the views touch become
    resident; it starts 2^31 elements before them, so a wrapped offset reads zeros inside it."""
    try:
        storage = torch.empty(2**32 + 2**28, dtype=torch.float16)
    except RuntimeError:
        pytest.skip("8.5 GiB of virtual memory refused (vm.overcommit_memory = 2?)")
    torch.manual_seed(0)
    views = [storage.as_strided(size, stride, 2**31 + 2**20 + 16 * i) for i in range(3)]
    for view in views:
        view.copy_(torch.randn(size))
    views = [view.requires_grad_() for view in views]
    dense = [view.detach().contiguous().requires_grad_() for view in views]
    grad_out = torch.randn(size, dtype=torch.float16)
    for variants in ((), ALL_VARIANTS):  # the variants read q, k, v through them too
        attend = lambda *qkv, chosen=variants: triton_causal_attention(*qkv, variants=chosen)  # noqa: E731
        got = _outputs_and_grads(attend, *views, grad_out)
        want = _outputs_and_grads(attend, *dense, grad_out)
        for name, a, b in zip(["Y", "dQ", "dK", "dV"], got, want, strict=True):
            assert torch.equal(a, b), (variants, name)


@triton.jit
def _one_position_late(q_pos, k_pos):
    return k_pos <= q_pos + 1  # sees one key of the future


@triton.jit
def _one_tile_late(q_pos, k_pos):
    return k_pos < q_pos - q_pos % 16 + 16  # the whole diagonal tile (TILE)


@pytest.mark.parametrize("leak", [_one_position_late, _one_tile_late])
def test_a_kernel_with_a_leaky_mask_fails_the_equality_and_the_causality_checks(monkeypatch, leak):
    """Negative controls for this file's equality tests and test_causality's triton cases: a
    mask off by one position, or the diagonal tile left unmasked, must be caught."""
    torch.manual_seed(0)
    q, k, v = _qkv(1, 2, 37, 16)
    expected = _manual(q, k, v)
    monkeypatch.setattr(kernel, "visible", leak)
    assert not torch.allclose(triton_causal_attention(q, k, v), expected, atol=1e-3)
    model = GPT(tiny_config(attention="triton", block_size=40)).eval()
    assert find_leaks(model)


@pytest.mark.parametrize(
    "variants", [*((name,) for name in ALL_VARIANTS), ALL_VARIANTS], ids="+".join
)
def test_each_variant_alone_and_together_gives_the_formulas_outputs_and_gradients(variants):
    """Issue 61's variants (model/triton_attention.py's module doc): float32 within 1e-5 of the
    formula on a ragged multi-tile shape and a padded head size; bfloat16 within 3 times the
    formula's own error; dropout through the default kernel's masks (the same Philox draws)."""
    torch.manual_seed(0)
    for B, H, T, hs in [(2, 3, 37, 16), (1, 1, 33, 96)]:
        q, k, v = _qkv(B, H, T, hs)
        grad_out = torch.randn(B, H, T, hs)
        got = _outputs_and_grads(
            lambda *qkv: triton_causal_attention(*qkv, variants=variants), q, k, v, grad_out
        )
        want = _outputs_and_grads(_manual, q, k, v, grad_out)
        for name, a, b in zip(["Y", "dQ", "dK", "dV"], got, want, strict=True):
            torch.testing.assert_close(
                a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in _qkv(2, 3, 40, 32))
    grad_out = torch.randn(2, 3, 40, 32).bfloat16()
    got = _outputs_and_grads(
        lambda *qkv: triton_causal_attention(*qkv, variants=variants), q, k, v, grad_out
    )
    half = _outputs_and_grads(_manual, q, k, v, grad_out)
    wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
    exact = _outputs_and_grads(_manual, *wide, grad_out.float())
    for name, a, h, e in zip(["Y", "dQ", "dK", "dV"], got, half, exact, strict=True):
        assert 0 < (a.float() - e).abs().max() <= 3 * (h.float() - e).abs().max(), name
    q, k, v = _qkv(1, 2, 37, 16)
    grad_out = torch.randn(1, 2, 37, 16)
    dropped = [
        _outputs_and_grads(
            lambda *qkv, chosen=chosen: triton_causal_attention(*qkv, 0.3, 7, variants=chosen),
            q,
            k,
            v,
            grad_out,
        )  # fmt: skip
        for chosen in (variants, ())
    ]
    for a, b in zip(*dropped, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_descriptors_keep_the_pointers_where_a_start_or_stride_is_off_16_bytes():
    """The `descriptors` variant runs where TMA can address every (batch, head) (the equality
    tests above run it); a view 4 bytes off, or rows of 12 bytes, keep the pointer path, with
    the formula's outputs."""
    torch.manual_seed(0)
    chosen = kernel.VARIANTS["descriptors"]
    aligned = torch.randn(1, 2, 20, 16)
    off = torch.randn(aligned.numel() + 1)[1:].view(aligned.shape)  # its start 4 bytes on
    narrow = torch.randn(1, 2, 20, 3)
    assert kernel._constants(0.0, chosen, aligned, aligned)["DESCRIPTORS"]
    assert not kernel._constants(0.0, 0, aligned, aligned)["DESCRIPTORS"]  # not chosen
    assert not kernel._constants(0.0, chosen, aligned, off)["DESCRIPTORS"]
    assert not kernel._constants(0.0, chosen, narrow)["DESCRIPTORS"]
    for q in (off, narrow):
        got = triton_causal_attention(q, q, q, variants=("descriptors",))
        torch.testing.assert_close(got, _manual(q, q, q), atol=1e-5, rtol=1e-5)


def test_the_variants_pass_the_causality_audit_and_a_leak_in_them_fails_it(monkeypatch):
    """One attention layer through the kernel with every variant, as a language model of ids:
    assert_causal's perturbation check passes, and fails once the mask sees one key late."""
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(64, 3 * 2 * 16), torch.nn.Linear(2 * 16, 64)

    def lm(ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        q, k, v = (t.view(B, T, 2, 16).transpose(1, 2) for t in embed(ids).split(32, dim=2))
        y = triton_causal_attention(q, k, v, variants=ALL_VARIANTS)
        return head(y.transpose(1, 2).reshape(B, T, 32))

    assert_causal(lm, seq_len=37)
    monkeypatch.setattr(kernel, "visible", _one_position_late)
    with pytest.raises(CausalityError, match="not causal"):
        assert_causal(lm, seq_len=37)


@pytest.mark.parametrize("options", ["gpt2", "all"])
def test_the_model_with_triton_gives_manual_logits_and_gradients(options):
    assert_gives_manuals_logits_and_gradients(options, T=24, attention="triton")  # 2 tiles


def test_dropout_is_manual_attention_with_the_kernels_masks():
    """With V the identity, Y = (P * keep / (1 - p)) V is the dropped P itself: read the masks
    out, then the formula with those masks must give the kernel's outputs and gradients for
    any V, so the backward pass regenerated the forward's masks."""
    torch.manual_seed(0)
    p, seed, T, hs = 0.3, 123, 30, 32
    q, k, v = _qkv(2, 2, T, hs)
    eye = torch.eye(T, hs).expand(2, 2, T, hs)
    dropped = triton_causal_attention(q, k, eye, dropout_p=p, seed=seed)[..., :T]  # (2, 2, T, T)
    probs = causal_attention(q, k, v, torch.ones(T, T, dtype=torch.bool).tril(), with_probs=True)[1]
    keep = dropped != 0
    torch.testing.assert_close(dropped, probs * keep / (1 - p), atol=1e-6, rtol=1e-5)
    assert keep[probs > 0].float().mean().item() == pytest.approx(1 - p, abs=0.05)
    expected = (probs * keep / (1 - p)) @ v
    out = triton_causal_attention(q, k, v, dropout_p=p, seed=seed)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k, v), grad_out), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dropout_masks_follow_torch_seed():
    q, k, v = _qkv(1, 2, 20, 16)
    torch.manual_seed(1)
    a = triton_causal_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(1)
    b = triton_causal_attention(q, k, v, dropout_p=0.5)
    c = triton_causal_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def _correlations(masks: torch.Tensor) -> torch.Tensor:
    """The correlation matrix of the rows of `masks` (n, elements), as 0/1 draws."""
    return torch.corrcoef(masks.flatten(1).double())


def test_dropout_masks_of_heads_and_of_adjacent_seeds_are_independent():
    """Seeds s and s + 1 and the heads of one call draw unrelated masks: every pair of the 2 x 4
    (batch, head) masks correlates by less than 0.1 (2,080 draws each: 4.6 standard errors).
    Seeding each head's stream with seed + (batch, head) made head 1 of seed s head 0 of s + 1."""
    torch.manual_seed(0)
    q, k, _ = _qkv(2, 2, 64, 64)
    eye = torch.eye(64).expand(2, 2, 64, 64)  # Y = the dropped P (test above)
    visible = torch.ones(64, 64, dtype=torch.bool).tril()
    masks = [triton_causal_attention(q, k, eye, 0.5, s) != 0 for s in (7, 8)]
    masks = torch.cat([m[..., visible].flatten(0, 1) for m in masks])  # (8, 2080)
    off_diagonal = _correlations(masks)[~torch.eye(8, dtype=torch.bool)]
    assert off_diagonal.abs().max() < 0.1


@triton.jit
def _keep_at(OUT, ROWS, COLS, seed, bh, T, N: tl.constexpr):
    i = tl.arange(0, N)
    rows, cols = tl.load(ROWS + i), tl.load(COLS + i)
    tl.store(OUT + i, kernel.keep(seed, bh, rows, cols, T, 0.5).to(tl.int8))


def test_dropout_masks_of_rows_past_46k_are_independent():
    """At T = 2^17, rows r and r + 2^15 of a head draw unrelated masks (a 32-bit `rows * T + cols`
    wraps past T = 46,341 and repeats itself past 65,536: there row r + 2^15 drew row r's), and
    the masks keep half."""
    torch.manual_seed(0)
    T, n = 2**17, 4096
    rows, cols = torch.randint(0, 2**15, (n,), dtype=torch.int32), torch.randint(0, T, (n,))
    masks = torch.empty(2, n, dtype=torch.int8)
    for i, r in enumerate([rows, rows + 2**15]):
        _keep_at[(1,)](masks[i], r, cols.int(), 7, 1, T, n)
    assert _correlations(masks)[0, 1].abs() < 0.1  # 6.4 standard errors
    assert masks.float().mean().item() == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize(
    "tuned,tiles",
    [
        ("forward", (16, 32)),
        ("backward_dk_dv", (32, 16)),
        ("backward_dq", (16, 32)),
        ("backward_paired", (32, 16)),
    ],
)
def test_a_tile_that_is_not_a_multiple_of_the_one_it_walks_fails_to_compile(
    monkeypatch, tuned, tiles
):
    """The diagonal tile is walked in steps of the other tile (tilings): a configuration that
    breaks this would mask the wrong keys, so it is a compile-time error, not a wrong answer."""
    bad = triton.Config(dict(BLOCK_M=tiles[0], BLOCK_N=tiles[1]))
    monkeypatch.setattr(getattr(kernel, tuned), "configs", [bad])
    q, k, v = _qkv(1, 1, 40, 16)
    variants = ("one_launch",) if tuned == "backward_paired" else ()
    with pytest.raises(Exception, match="must be a multiple of"):
        triton_causal_attention(q, k, v, variants=variants).sum().backward()


def test_one_launch_with_its_own_tiles_twice_those_it_walks_gives_the_formulas_gradients(
    monkeypatch,
):
    """The paired backward's programs own BLOCK_N rows (keys for dK dV, queries for dQ) and walk
    the others BLOCK_M at a time: with 32 and 16, not the interpreter's equal 16s, its dQ half
    crosses the diagonal in two steps."""
    config = triton.Config(dict(BLOCK_M=16, BLOCK_N=32))
    monkeypatch.setattr(kernel.backward_paired, "configs", [config])
    torch.manual_seed(0)
    q, k, v = _qkv(2, 1, 45, 16)
    grad_out = torch.randn(2, 1, 45, 16)
    attend = lambda *qkv: triton_causal_attention(*qkv, variants=("one_launch",))  # noqa: E731
    got = _outputs_and_grads(attend, q, k, v, grad_out)
    want = _outputs_and_grads(_manual, q, k, v, grad_out)
    for name, a, b in zip(["Y", "dQ", "dK", "dV"], got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_every_switch_of_a_kernel_is_in_its_autotune_key():
    """Dropout draws Philox numbers per element; each variant is another compiled kernel: the
    fastest tiles of each are tuned apart. Every compile-time argument of a kernel but its tiles
    and PRECISION (the dtype's, which autotune keys on itself) is in its key."""
    for tuned in (
        kernel.forward,
        kernel.backward_dk_dv,
        kernel.backward_paired,
        kernel.backward_dq,
    ):
        signature = inspect.signature(tuned.fn.fn)
        switches = {
            name
            for name, parameter in signature.parameters.items()
            if parameter.annotation in ("tl.constexpr", tl.constexpr)
            and not name.startswith("BLOCK_")
            and name != "PRECISION"
        }
        assert "DROPOUT" in switches, signature  # the annotations were read
        assert {"T", *switches} <= set(tuned.keys), (tuned.fn.fn.__name__, tuned.keys)


def test_torch_compile_traces_the_model_through_the_operator_without_a_graph_break():
    model = GPT(tiny_config(attention="triton", block_size=20))
    idx = torch.randint(0, 101, (2, 20))
    explained = torch._dynamo.explain(lambda i: model(i, i)[1])(idx)
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_without_a_gpu_or_the_interpreter_it_is_one_error_line(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET")
    model = GPT(tiny_config(attention="triton")).eval()
    with pytest.raises(ConfigError, match="needs|CUDA GPU, not on cpu.*TRITON_INTERPRET=1"):
        model(torch.randint(0, 101, (1, 8)))
    result = run_script("train.py", "model=nano", "model.attention=triton", cwd=tmp_path)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("error: model.attention=triton runs its kernel on a CUDA GPU, not on cpu")
    )
    assert not any(tmp_path.iterdir())  # no run directory left behind


def test_evaluate_py_scores_a_triton_checkpoint_through_sdpa_where_the_kernel_cannot_run(
    monkeypatch, tmp_path
):
    """attention is a run-time field: a model trained with the kernel on a GPU is evaluated on a
    CPU through sdpa, to the kernel's loss (scored here under the interpreter first)."""
    from evals.loss import evaluate_checkpoint
    from tests.conftest import TEXT, save_tiny_checkpoint

    path, _ = save_tiny_checkpoint(tmp_path, attention="triton")
    (tmp_path / "text.txt").write_text(TEXT * 3)
    cfg = dict(checkpoint=str(path), text_file=str(tmp_path / "text.txt"), task=None, tasks=[])
    cfg |= dict(batch_size=2, stride=None, device="cpu", dtype="float32", dataset=None)
    with_kernel = evaluate_checkpoint(cfg, say=lambda line: None)
    monkeypatch.delenv("TRITON_INTERPRET")
    said = []
    through_sdpa = evaluate_checkpoint(cfg, say=said.append)
    assert through_sdpa["loss"] == pytest.approx(with_kernel["loss"], abs=1e-5)
    assert said[0] == (  # said once, before the scores
        "model.attention=triton runs its kernel on a CUDA GPU, not on cpu: use a GPU, or set "
        "TRITON_INTERPRET=1 to run it (slowly) under Triton's interpreter; scoring through "
        "model.attention=sdpa, the same function"
    )


@pytest.mark.parametrize(
    "tiles, owner",  # the tile a kernel owns is a multiple of the one it walks (static_assert)
    [
        (kernel.FORWARD_TILES, "BLOCK_M"),
        (kernel.DK_DV_TILES, "BLOCK_N"),
        (kernel.DQ_TILES, "BLOCK_M"),
    ],
)
def test_autotune_times_tiles_that_fit_the_dtype_and_the_head_size(monkeypatch, tiles, owner):
    """On a GPU each kernel times the configurations `fitting` keeps for its call: float32 only
    tiles of 64 x 64 at most (larger ones spill and are slow to compile), half precision
    at a head of 128 no 128-row tile on 4 warps; at least one each time, and every one a
    configuration the kernel compiles."""
    monkeypatch.setattr(kernel, "INTERPRETED", False)  # the GPU's list, not the interpreter's one
    configs = kernel.tilings(*tiles)
    walked = "BLOCK_N" if owner == "BLOCK_M" else "BLOCK_M"
    assert all(c.kwargs[owner] % c.kwargs[walked] == 0 for c in configs)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for hs in (64, 96, 128):
            kept = kernel.fitting(configs, {"Q": torch.empty(1, dtype=dtype)}, HS=hs)
            assert kept, (dtype, hs)
            if dtype == torch.float32:
                assert all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64 for c in kept)
            elif hs > 64:
                assert not [c for c in kept if c.num_warps == 4 and 128 in c.kwargs.values()]
            else:
                assert len(kept) > len(kernel.fitting(configs, {"Q": torch.empty(1)}, HS=hs))
