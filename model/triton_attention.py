"""Causal attention as a Triton GPU kernel (`attention: triton`): model/flash_attention.py's
algorithm with one GPU program per tile where flash has a Python loop.

The formula and the names are model/gpt.py's: S = Q K^T / sqrt(d_k), -inf above the diagonal,
P = softmax(S), Y = P V; m and l are a row's running max and sum of exp(S - m), LSE = m + log(l).

- forward (`_forward`): one program per query tile of one (batch, head). It walks the key tiles
  left of the diagonal without a mask, then the tiles crossing it with one (`visible`); tiles
  above the diagonal are never loaded. The online softmax rescales the output accumulator as m
  grows; only Y and the row's LSE are stored, never S.
- backward: the design of Triton's fused-attention tutorial, deterministic, not FlashAttention-2's
  (one kernel, dQ accumulated with float32 atomics: 5 matmuls per pair of tiles). Two kernels
  recompute P = exp(S - LSE) tile by tile, 7 matmuls per pair of tiles, with D = rowsum(dO * Y)
  computed first:
  `_backward_dk_dv`, one program per key tile, walks the query tiles at and below the diagonal:
  dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dK += dS^T Q / sqrt(d_k);
  `_backward_dq`, one program per query tile, walks the key tiles as the forward does:
  dQ += dS K / sqrt(d_k). Each program owns the rows it writes, so no atomics are needed.
- dropout on P: each element's keep-mask is a Philox random number (tl.rand) of the call's seed
  and the element's index, so the backward regenerates the forward's masks without storing them.
  The softmax's sum l is taken before dropout, as flash and torch's dropout on S do.

Scores, softmax and accumulators are float32; the matmul inputs stay in the input dtype (tensor
cores for bfloat16 and float16; float32 multiplies in full float32, not TF32). A head size that
is not a power of two (96) is padded to the next one in registers; a T that is not a multiple of
the tile has its last tile masked. The (batch, head) index and the row positions are widened to
64 bits before they multiply a stride: q, k and v are views of the fused (B, T, 3C) projection,
whose B T 3C elements pass 2^31 at long contexts or in wide models, where 32-bit offsets would
wrap silently. Where Triton has no backend (a CPU), it runs under Triton's interpreter when
TRITON_INTERPRET=1 is set before Python starts (numpy: slow, for tests); model/gpt.py refuses it
in one line anywhere else (`unavailable_attention`).

`triton_causal_attention` is a torch custom operator whose backward is registered with
torch.library, so torch.compile traces a model through it without a graph break.

Variants (issue 61), each a switch of these kernels, kept by default only once a GPU's ablation
row (scripts/gpu_check.sh) shows it faster; until then `triton_causal_attention(variants=...)`
and benchmarks/bench_attention.py's `triton+<variant>` select them:
- `log2`: the softmax in base 2 end to end, log2(e) folded into the score scale and the LSE
  stored in log2 units, as Triton's tutorial does: one multiply fewer per score, in each kernel.
- `fused_d`: D = rowsum(dO * Y) by a Triton kernel (`_preprocess`), not by eager PyTorch's
  multiply, upcasts and sum (three passes over dO and Y, two temporaries).
- `one_launch`: the backward in one kernel (`_backward_paired`), the tutorial's pairing: program
  i computes dK and dV of key tile i and dQ of query tile i. The first walks the query tiles
  after the diagonal, the second the key tiles before it: every program does about the same
  work, and one launch replaces two.
- `heavy_first`: the forward's and dQ's programs take the query tiles last to first. Under the
  causal mask the last tile walks every key tile, the first one; started first, the long ones
  do not trail the short ones at the end of the grid (dK dV's first key tiles are its heaviest,
  and already first).
- `half_diagonal`: the backward's tiles that cross the diagonal, where `visible` masks, walked in
  steps of half the tile (the tutorial's BLK_SLICE_FACTOR = 2): the same work in smaller pieces,
  fewer registers live for the masked ones, for the GPU's ablation to weigh.
- `descriptors`: the tiles of Q, K, V, dO read and of Y, dQ, dK, dV written through tensor
  descriptors (`tiles_of`), made once per program and walk: on Hopper the TMA unit copies a
  whole tile, zeros past T and HS included, where the pointer path has every thread compute and
  mask its addresses. Before Hopper, or where a start or stride is not a multiple of 16 bytes
  (`_descriptors_fit`), the kernels keep their pointers.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x log2(e)): the GPU's own instruction
VARIANTS = {
    "log2": 1,
    "fused_d": 2,
    "heavy_first": 4,
    "one_launch": 8,
    "half_diagonal": 16,
    "descriptors": 32,
}


# The kernels' arguments one per line would bury the algorithm:
# fmt: off


@triton.jit
def mm(a, b, PRECISION: tl.constexpr):
    """a @ b, accumulated in float32. Triton's interpreter multiplies bfloat16 tiles as their
    raw bits, so there they are widened first: exact, as tensor cores multiply them."""
    if INTERPRETED:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def tiles_of(X, stride_t, T, HS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
             DESCRIPTORS: tl.constexpr):
    """One (batch, head)'s X (T, HS) for rows_of and store_rows to move BLOCK rows at a time:
    with DESCRIPTORS a tensor descriptor (made once, before a walk), else X's pointer itself."""
    if DESCRIPTORS:
        return tl.make_tensor_descriptor(X, [T, HS], [stride_t, 1], [BLOCK, BLOCK_D])
    return X


@triton.jit
def rows_of(X, start, pos, dims, stride_t, T, HS: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """Rows pos = start + arange of tiles_of's X: zeros past T (the ragged last tile) and past HS
    (a head size padded to a power of two), by the descriptor's bounds or by a mask."""
    if DESCRIPTORS:
        return X.load([start, 0])
    inside = (pos[:, None] < T) & (dims[None, :] < HS)
    return tl.load(X + pos[:, None].to(tl.int64) * stride_t + dims[None, :], mask=inside, other=0.0)


@triton.jit
def store_rows(X, value, start, pos, dims, stride_t, T, HS: tl.constexpr,
               DESCRIPTORS: tl.constexpr):
    """Write `value` to rows pos = start + arange of tiles_of's X, inside its bounds."""
    if DESCRIPTORS:
        X.store([start, 0], value.to(X.dtype))
    else:
        inside = (pos[:, None] < T) & (dims[None, :] < HS)
        at = X + pos[:, None].to(tl.int64) * stride_t + dims[None, :]
        tl.store(at, value.to(X.dtype.element_ty), mask=inside)


@triton.jit
def exp(x, LOG2: tl.constexpr):
    """e^x; with LOG2, x is in log2 units already (scores scaled by log2(e)): 2^x."""
    if not LOG2:
        x = x * LOG2E
    return tl.math.exp2(x)


@triton.jit
def query_tile(HEAVY_FIRST: tl.constexpr):
    """This program's query tile: program_id(0), or counted from the end with HEAVY_FIRST."""
    if HEAVY_FIRST:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    return tl.program_id(0)


@triton.jit
def visible(q_pos, k_pos):
    """The causal mask: query position q_pos may see key position k_pos iff k_pos <= q_pos."""
    return k_pos <= q_pos


@triton.jit
def keep(seed, bh, rows, cols, T, dropout_p):
    """Dropout's keep-mask of the elements (rows, cols) of (batch, head) bh's P: a pure function
    of its arguments, so forward and backward draw the same mask. Philox's counter is the
    element's 64-bit index in the call's (B nh, T, T) scores and its key the call's seed: no two
    elements of a call share a random number at any T, and calls with different seeds share
    none (`seed + bh` with a 32-bit `rows * T + cols` repeated both)."""
    return tl.rand(seed, (bh.to(tl.int64) * T + rows) * T + cols) >= dropout_p


@triton.jit
def _forward_tiles(acc, m, l, q, K, V, stride_kt, stride_vt, rows, dims, T, k_lo, k_hi, scale, seed,
                   bh, dropout_p, HS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                   DROPOUT: tl.constexpr, PRECISION: tl.constexpr, LOG2: tl.constexpr,
                   DESCRIPTORS: tl.constexpr):
    """The online softmax over the key tiles [k_lo, k_hi) for one query tile; MASKED: the tiles
    crossing the diagonal (and the ragged end), where `visible` decides."""
    for k0 in range(k_lo, k_hi, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)  # key positions
        k = rows_of(K, k0, cols, dims, stride_kt, T, HS, DESCRIPTORS)  # (BLOCK_N, BLOCK_D)
        v = rows_of(V, k0, cols, dims, stride_vt, T, HS, DESCRIPTORS)
        s = mm(q, tl.trans(k), PRECISION) * scale  # S: (BLOCK_M, BLOCK_N)
        if MASKED:
            s = tl.where(visible(rows[:, None], cols[None, :]), s, float("-inf"))
        # Key 0 is in every row's first tile, so m is finite from then on: exp(-inf - m) = 0.
        m_new = tl.maximum(m, tl.max(s, 1))
        p = exp(s - m_new[:, None], LOG2)  # P, unnormalised: (BLOCK_M, BLOCK_N)
        alpha = exp(m - m_new, LOG2)  # rescales what was summed under the old max
        l = l * alpha + tl.sum(p, 1)  # the softmax's denominator, undropped
        if DROPOUT:
            p = tl.where(keep(seed, bh, rows[:, None], cols[None, :], T, dropout_p), p, 0.0)
            p = p / (1.0 - dropout_p)
        acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, PRECISION)  # (BLOCK_M, BLOCK_D)
        m = m_new
    return acc, m, l


@triton.jit
def _forward(Q, K, V, Y, LSE, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
             stride_vb, stride_vh, stride_vt, stride_yb, stride_yh, stride_yt, H, T, scale, SEED,
             dropout_p, HS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
             LOG2: tl.constexpr, HEAVY_FIRST: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """Y and LSE of query tile `query_tile` of (batch, head) program_id(1)."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0, "BLOCK_M must be a multiple of BLOCK_N (tilings)")
    tile, bh = query_tile(HEAVY_FIRST), tl.program_id(1).to(tl.int64)  # 64-bit offsets (doc)
    b, h = bh // H, bh % H
    Q = tiles_of(Q + b * stride_qb + h * stride_qh, stride_qt, T, HS, BLOCK_M, BLOCK_D, DESCRIPTORS)
    K = tiles_of(K + b * stride_kb + h * stride_kh, stride_kt, T, HS, BLOCK_N, BLOCK_D, DESCRIPTORS)
    V = tiles_of(V + b * stride_vb + h * stride_vh, stride_vt, T, HS, BLOCK_N, BLOCK_D, DESCRIPTORS)
    Y = tiles_of(Y + b * stride_yb + h * stride_yh, stride_yt, T, HS, BLOCK_M, BLOCK_D, DESCRIPTORS)
    diagonal = tile * BLOCK_M  # keys before it are in the past of every row of the tile
    rows = diagonal + tl.arange(0, BLOCK_M)  # query positions
    dims = tl.arange(0, BLOCK_D)
    q = rows_of(Q, diagonal, rows, dims, stride_qt, T, HS, DESCRIPTORS)  # (BLOCK_M, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    seed = tl.load(SEED)
    if LOG2:
        scale *= LOG2E  # the scores in log2 units
    acc, m, l = _forward_tiles(acc, m, l, q, K, V, stride_kt, stride_vt, rows, dims, T, 0, diagonal,
                               scale, seed, bh, dropout_p, HS, BLOCK_N, False, DROPOUT, PRECISION,
                               LOG2, DESCRIPTORS)
    acc, m, l = _forward_tiles(acc, m, l, q, K, V, stride_kt, stride_vt, rows, dims, T, diagonal,
                               diagonal + BLOCK_M, scale, seed, bh, dropout_p, HS, BLOCK_N, True,
                               DROPOUT, PRECISION, LOG2, DESCRIPTORS)
    y = acc / l[:, None]
    store_rows(Y, y, diagonal, rows, dims, stride_yt, T, HS, DESCRIPTORS)
    lse = m + (tl.log2(l) if LOG2 else tl.log(l))
    tl.store(LSE + bh * T + rows, lse, mask=rows < T)


@triton.jit
def _dk_dv_tiles(dk, dv, k, v, Q, DO, LSE, D, stride_qt, stride_dot, cols, dims, T, q_lo, q_hi,
                 scale, seed, bh, dropout_p, HS: tl.constexpr, BLOCK_M: tl.constexpr,
                 MASKED: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
                 LOG2: tl.constexpr, BLOCK_D: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """dK and dV of one key tile from the query tiles [q_lo, q_hi), transposed: the tile's
    rows are its keys, so P^T, dP^T and dS^T come straight out of the matmuls."""
    Q = tiles_of(Q, stride_qt, T, HS, BLOCK_M, BLOCK_D, DESCRIPTORS)
    DO = tiles_of(DO, stride_dot, T, HS, BLOCK_M, BLOCK_D, DESCRIPTORS)
    for q0 in range(q_lo, q_hi, BLOCK_M):
        rows = q0 + tl.arange(0, BLOCK_M)  # query positions
        q = rows_of(Q, q0, rows, dims, stride_qt, T, HS, DESCRIPTORS)  # (BLOCK_M, BLOCK_D)
        do = rows_of(DO, q0, rows, dims, stride_dot, T, HS, DESCRIPTORS)
        lse = tl.load(LSE + rows, mask=rows < T, other=0.0)
        d = tl.load(D + rows, mask=rows < T, other=0.0)
        s_t = mm(k, tl.trans(q), PRECISION) * scale  # S^T: (BLOCK_N, BLOCK_M)
        p_t = exp(s_t - lse[None, :], LOG2)  # the forward's P, recomputed
        if MASKED:
            p_t = tl.where(visible(rows[None, :], cols[:, None]), p_t, 0.0)
        dp_t = mm(v, tl.trans(do), PRECISION)  # dP^T = V dO^T
        p_used = p_t  # P as the forward multiplied it into V: after dropout
        if DROPOUT:
            z = tl.where(keep(seed, bh, rows[None, :], cols[:, None], T, dropout_p), 1.0, 0.0)
            z = z / (1.0 - dropout_p)
            p_used, dp_t = p_t * z, dp_t * z
        dv += mm(p_used.to(do.dtype), do, PRECISION)  # P^T dO
        ds_t = p_t * (dp_t - d[None, :])  # the softmax's backward
        dk += mm(ds_t.to(q.dtype), q, PRECISION)  # dS^T Q (times the scale at the end)
    return dk, dv


@triton.jit
def _key_tile(Q, K, V, DO, LSE, D, stride_qt, stride_kt, stride_vt, stride_ot, tile, T, scale, seed,
              bh, dropout_p, HS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
              LOG2: tl.constexpr, HALF_DIAGONAL: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """dK and dV of key tile `tile` (BLOCK_N keys) of the (batch, head) the pointers are at:
    the query tiles at and after the diagonal, BLOCK_M at a time (across the diagonal
    BLOCK_M / 2 with HALF_DIAGONAL)."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0, "BLOCK_N must be a multiple of BLOCK_M (tilings)")
    diagonal = tile * BLOCK_N  # queries before it see none of these keys: never visited
    cols = diagonal + tl.arange(0, BLOCK_N)  # key positions
    dims = tl.arange(0, BLOCK_D)
    K = tiles_of(K, stride_kt, T, HS, BLOCK_N, BLOCK_D, DESCRIPTORS)
    V = tiles_of(V, stride_vt, T, HS, BLOCK_N, BLOCK_D, DESCRIPTORS)
    k = rows_of(K, diagonal, cols, dims, stride_kt, T, HS, DESCRIPTORS)  # the tile
    v = rows_of(V, diagonal, cols, dims, stride_vt, T, HS, DESCRIPTORS)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E if LOG2 else scale  # the forward's scores; dK's scale stays natural
    dk, dv = _dk_dv_tiles(dk, dv, k, v, Q, DO, LSE, D, stride_qt, stride_ot, cols, dims, T,
                          diagonal, diagonal + BLOCK_N, qk_scale, seed, bh, dropout_p, HS,
                          BLOCK_M >> HALF_DIAGONAL, True, DROPOUT, PRECISION, LOG2, BLOCK_D,
                          DESCRIPTORS)
    dk, dv = _dk_dv_tiles(dk, dv, k, v, Q, DO, LSE, D, stride_qt, stride_ot, cols, dims, T, diagonal
                          + BLOCK_N, T, qk_scale, seed, bh, dropout_p, HS, BLOCK_M, False, DROPOUT,
                          PRECISION, LOG2, BLOCK_D, DESCRIPTORS)
    return dk * scale, dv


@triton.jit
def _backward_dk_dv(Q, K, V, DO, DK, DV, LSE, D, stride_qb, stride_qh, stride_qt, stride_kb,
                    stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_ob, stride_oh,
                    stride_ot, stride_gb, stride_gh, stride_gt, H, T, scale, SEED, dropout_p,
                    HS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
                    LOG2: tl.constexpr, HALF_DIAGONAL: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """dK and dV of key tile program_id(0) of (batch, head) program_id(1); dO's strides are
    stride_o*, dK's and dV's stride_g*."""
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit offsets (module doc)
    b, h = bh // H, bh % H
    dk, dv = _key_tile(Q + b * stride_qb + h * stride_qh, K + b * stride_kb + h * stride_kh,
                       V + b * stride_vb + h * stride_vh, DO + b * stride_ob + h * stride_oh,
                       LSE + bh * T, D + bh * T, stride_qt, stride_kt, stride_vt, stride_ot, tile,
                       T, scale, tl.load(SEED), bh, dropout_p, HS, BLOCK_D, BLOCK_M, BLOCK_N,
                       DROPOUT, PRECISION, LOG2, HALF_DIAGONAL, DESCRIPTORS)
    start, dims = tile * BLOCK_N, tl.arange(0, BLOCK_D)
    cols, out = start + tl.arange(0, BLOCK_N), b * stride_gb + h * stride_gh  # the tile's keys
    DK = tiles_of(DK + out, stride_gt, T, HS, BLOCK_N, BLOCK_D, DESCRIPTORS)
    DV = tiles_of(DV + out, stride_gt, T, HS, BLOCK_N, BLOCK_D, DESCRIPTORS)
    store_rows(DK, dk, start, cols, dims, stride_gt, T, HS, DESCRIPTORS)
    store_rows(DV, dv, start, cols, dims, stride_gt, T, HS, DESCRIPTORS)


@triton.jit
def _dq_tiles(dq, q, do, lse, d, K, V, stride_kt, stride_vt, rows, dims, T, k_lo, k_hi, scale, seed,
              bh, dropout_p, HS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              DROPOUT: tl.constexpr, PRECISION: tl.constexpr, LOG2: tl.constexpr,
              BLOCK_D: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """dQ of one query tile from the key tiles [k_lo, k_hi)."""
    K = tiles_of(K, stride_kt, T, HS, BLOCK_N, BLOCK_D, DESCRIPTORS)
    V = tiles_of(V, stride_vt, T, HS, BLOCK_N, BLOCK_D, DESCRIPTORS)
    for k0 in range(k_lo, k_hi, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)  # key positions
        k = rows_of(K, k0, cols, dims, stride_kt, T, HS, DESCRIPTORS)  # (BLOCK_N, BLOCK_D)
        v = rows_of(V, k0, cols, dims, stride_vt, T, HS, DESCRIPTORS)
        s = mm(q, tl.trans(k), PRECISION) * scale  # S: (BLOCK_M, BLOCK_N)
        p = exp(s - lse[:, None], LOG2)  # the forward's P, recomputed
        if MASKED:
            p = tl.where(visible(rows[:, None], cols[None, :]), p, 0.0)
        dp = mm(do, tl.trans(v), PRECISION)  # dP = dO V^T
        if DROPOUT:
            z = tl.where(keep(seed, bh, rows[:, None], cols[None, :], T, dropout_p), 1.0, 0.0)
            dp = dp * z / (1.0 - dropout_p)
        ds = p * (dp - d[:, None])  # the softmax's backward
        dq += mm(ds.to(k.dtype), k, PRECISION)  # dS K (times the scale at the end)
    return dq


@triton.jit
def _query_tile(Q, K, V, DO, LSE, D, stride_qt, stride_kt, stride_vt, stride_ot, tile, T, scale,
                seed, bh, dropout_p, HS: tl.constexpr, BLOCK_D: tl.constexpr, OWN: tl.constexpr,
                WALK: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
                LOG2: tl.constexpr, HALF_DIAGONAL: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """dQ of query tile `tile` (OWN queries) of the (batch, head) the pointers are at: the key
    tiles before the diagonal and across it, WALK at a time (across it WALK / 2 with
    HALF_DIAGONAL)."""
    tl.static_assert(OWN % WALK == 0, "a program's own tile must be a multiple of the one it walks")
    diagonal = tile * OWN
    rows = diagonal + tl.arange(0, OWN)  # query positions
    dims = tl.arange(0, BLOCK_D)
    q = rows_of(tiles_of(Q, stride_qt, T, HS, OWN, BLOCK_D, DESCRIPTORS), diagonal, rows, dims,
                stride_qt, T, HS, DESCRIPTORS)
    do = rows_of(tiles_of(DO, stride_ot, T, HS, OWN, BLOCK_D, DESCRIPTORS), diagonal, rows, dims,
                 stride_ot, T, HS, DESCRIPTORS)
    lse = tl.load(LSE + rows, mask=rows < T, other=0.0)
    d = tl.load(D + rows, mask=rows < T, other=0.0)
    dq = tl.zeros([OWN, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E if LOG2 else scale  # the forward's scores; dQ's scale stays natural
    dq = _dq_tiles(dq, q, do, lse, d, K, V, stride_kt, stride_vt, rows, dims, T, 0, diagonal,
                   qk_scale, seed, bh, dropout_p, HS, WALK, False, DROPOUT, PRECISION, LOG2,
                   BLOCK_D, DESCRIPTORS)
    dq = _dq_tiles(dq, q, do, lse, d, K, V, stride_kt, stride_vt, rows, dims, T, diagonal, diagonal
                   + OWN, qk_scale, seed, bh, dropout_p, HS, WALK >> HALF_DIAGONAL, True, DROPOUT,
                   PRECISION, LOG2, BLOCK_D, DESCRIPTORS)
    return dq * scale


@triton.jit
def _backward_dq(Q, K, V, DO, DQ, LSE, D, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh,
                 stride_kt, stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                 stride_gb, stride_gh, stride_gt, H, T, scale, SEED, dropout_p, HS: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DROPOUT: tl.constexpr, PRECISION: tl.constexpr, LOG2: tl.constexpr,
                 HEAVY_FIRST: tl.constexpr, HALF_DIAGONAL: tl.constexpr,
                 DESCRIPTORS: tl.constexpr):
    """dQ of query tile `query_tile` of (batch, head) program_id(1); dO's strides are
    stride_o*, dQ's stride_g*."""
    tile, bh = query_tile(HEAVY_FIRST), tl.program_id(1).to(tl.int64)  # 64-bit offsets (doc)
    b, h = bh // H, bh % H
    dq = _query_tile(Q + b * stride_qb + h * stride_qh, K + b * stride_kb + h * stride_kh,
                     V + b * stride_vb + h * stride_vh, DO + b * stride_ob + h * stride_oh,
                     LSE + bh * T, D + bh * T, stride_qt, stride_kt, stride_vt, stride_ot, tile, T,
                     scale, tl.load(SEED), bh, dropout_p, HS, BLOCK_D, BLOCK_M, BLOCK_N, DROPOUT,
                     PRECISION, LOG2, HALF_DIAGONAL, DESCRIPTORS)
    start, dims, out = tile * BLOCK_M, tl.arange(0, BLOCK_D), b * stride_gb + h * stride_gh
    DQ = tiles_of(DQ + out, stride_gt, T, HS, BLOCK_M, BLOCK_D, DESCRIPTORS)
    store_rows(DQ, dq, start, start + tl.arange(0, BLOCK_M), dims, stride_gt, T, HS, DESCRIPTORS)


@triton.jit
def _backward_paired(Q, K, V, DO, DQ, DK, DV, LSE, D, stride_qb, stride_qh, stride_qt, stride_kb,
                     stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_ob, stride_oh,
                     stride_ot, stride_gb, stride_gh, stride_gt, H, T, scale, SEED, dropout_p,
                     HS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
                     LOG2: tl.constexpr, HALF_DIAGONAL: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """The `one_launch` variant: dK and dV of key tile program_id(0), as `_backward_dk_dv`, then
    dQ of the query tile at the same rows (BLOCK_N of them, walking the keys BLOCK_M at a time),
    as `_backward_dq`. dQ, dK and dV share the strides stride_g*."""
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit offsets (module doc)
    b, h = bh // H, bh % H
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_ob + h * stride_oh
    LSE += bh * T
    D += bh * T
    seed = tl.load(SEED)
    dk, dv = _key_tile(Q, K, V, DO, LSE, D, stride_qt, stride_kt, stride_vt, stride_ot, tile, T,
                       scale, seed, bh, dropout_p, HS, BLOCK_D, BLOCK_M, BLOCK_N, DROPOUT,
                       PRECISION, LOG2, HALF_DIAGONAL, DESCRIPTORS)
    dq = _query_tile(Q, K, V, DO, LSE, D, stride_qt, stride_kt, stride_vt, stride_ot, tile, T,
                     scale, seed, bh, dropout_p, HS, BLOCK_D, BLOCK_N, BLOCK_M, DROPOUT, PRECISION,
                     LOG2, HALF_DIAGONAL, DESCRIPTORS)
    start, dims = tile * BLOCK_N, tl.arange(0, BLOCK_D)
    pos, out = start + tl.arange(0, BLOCK_N), b * stride_gb + h * stride_gh  # keys, queries
    DK = tiles_of(DK + out, stride_gt, T, HS, BLOCK_N, BLOCK_D, DESCRIPTORS)
    DV = tiles_of(DV + out, stride_gt, T, HS, BLOCK_N, BLOCK_D, DESCRIPTORS)
    DQ = tiles_of(DQ + out, stride_gt, T, HS, BLOCK_N, BLOCK_D, DESCRIPTORS)
    store_rows(DK, dk, start, pos, dims, stride_gt, T, HS, DESCRIPTORS)
    store_rows(DV, dv, start, pos, dims, stride_gt, T, HS, DESCRIPTORS)
    store_rows(DQ, dq, start, pos, dims, stride_gt, T, HS, DESCRIPTORS)


@triton.jit
def _preprocess(Y, DO, D, stride_yb, stride_yh, stride_yt, stride_ob, stride_oh, stride_ot, H, T,
                HS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """D = rowsum(dO * Y) of query tile program_id(0) of (batch, head) program_id(1), in float32
    (the `fused_d` variant)."""
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit offsets (module doc)
    b, h = bh // H, bh % H
    start, dims = tile * BLOCK_M, tl.arange(0, BLOCK_D)
    rows = start + tl.arange(0, BLOCK_M)
    y = rows_of(Y + b * stride_yb + h * stride_yh, start, rows, dims, stride_yt, T, HS, False)
    do = rows_of(DO + b * stride_ob + h * stride_oh, start, rows, dims, stride_ot, T, HS, False)
    y, do = y.to(tl.float32), do.to(tl.float32)
    tl.store(D + bh * T + rows, tl.sum(do * y, 1), mask=rows < T)


# fmt: on


# ----- launching: tiles, and the torch custom operator ------------------------------------------


def tilings(*shapes: tuple[int, int, int, int]) -> list[triton.Config]:
    """Launch configurations (BLOCK_M, BLOCK_N, warps, stages) for triton.autotune, which times
    those `fitting` keeps on the first call per (T, head size, dtype, switches) and keeps the
    fastest. The interpreter's one: tiles of 16, so that the tests' short sequences cross
    several tiles."""
    if INTERPRETED:
        shapes = ((16, 16, 1, 1),)
    return [triton.Config(dict(BLOCK_M=m, BLOCK_N=n), num_warps=w, num_stages=s)
            for m, n, w, s in shapes]  # fmt: skip


def fitting(configs: list[triton.Config], args: dict, HS: int, **_) -> list[triton.Config]:
    """triton.autotune's early_config_prune: the configurations timed for this call's dtype and
    head size. float32, whose operands take twice the shared memory and multiply without tensor
    cores, times the two-stage ones, tiles of 64 x 64 at most: larger ones spill and are slow to
    compile (the check's float32 rows must fit its time). Half precision times the deeper
    pipelines, and for a head over 64 no 128-row tile on 4 warps: its float32 accumulator alone
    is 128 registers a thread."""
    if args["Q"].element_size() == 4:
        return [c for c in configs if c.num_stages <= 2]

    def spills(c: triton.Config) -> bool:
        return HS > 64 and c.num_warps == 4 and 128 in (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])

    return [c for c in configs if c.num_stages > 2 and not spills(c)]


# Each kernel's loops step through its diagonal tile in steps of the other tile, so the tile it
# owns is a multiple of the one it walks: the forward's and dQ's BLOCK_M, dK dV's BLOCK_N (each
# kernel's static_assert). Dropout's Philox draws and each variant change a kernel's fastest
# tiles, so they are tuned apart.
FORWARD_TILES = ((128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4), (64, 64, 4, 2),
                 (64, 32, 4, 2))  # fmt: skip
DK_DV_TILES = ((32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 4), (64, 64, 4, 2),
               (32, 64, 4, 2))  # fmt: skip
DQ_TILES = ((128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4), (64, 64, 4, 2),
            (64, 32, 4, 2))  # fmt: skip
KEY = ["T", "HS", "DROPOUT", "LOG2", "DESCRIPTORS", "HEAVY_FIRST"]
KEY_DQ = [*KEY, "HALF_DIAGONAL"]
KEY_DK_DV = [*KEY[:-1], "HALF_DIAGONAL"]  # its heaviest tiles, the first keys', come first already
PRUNE = dict(early_config_prune=fitting)
forward = triton.autotune(tilings(*FORWARD_TILES), KEY, prune_configs_by=PRUNE)(_forward)
backward_dk_dv = triton.autotune(tilings(*DK_DV_TILES), KEY_DK_DV, prune_configs_by=PRUNE)(
    _backward_dk_dv
)
backward_paired = triton.autotune(  # dK dV's tiles: the program's own rows are BLOCK_N
    tilings(*DK_DV_TILES), KEY_DK_DV, prune_configs_by=PRUNE
)(_backward_paired)
backward_dq = triton.autotune(tilings(*DQ_TILES), KEY_DQ, prune_configs_by=PRUNE)(_backward_dq)


def _launch_args(*tensors: torch.Tensor) -> list[int]:
    """The (batch, head, time) strides of each tensor; the last dimension must be dense."""
    return [s for t in tensors for s in t.stride()[:3]]


def _dense_last(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _constants(dropout_p: float, variants: int, q: torch.Tensor, *tensors: torch.Tensor) -> dict:
    """The compile-time constants every kernel takes, for q (B, nh, T, hs) and the tensors the
    kernels read and write beside it."""
    hs = q.size(-1)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # ieee: no TF32 for float32
    chosen = {name: bool(variants & bit) for name, bit in VARIANTS.items()}
    return dict(HS=hs, BLOCK_D=max(16, triton.next_power_of_2(hs)), DROPOUT=dropout_p > 0,
                PRECISION=precision, LOG2=chosen["log2"], HEAVY_FIRST=chosen["heavy_first"],
                DESCRIPTORS=chosen["descriptors"] and _descriptors_fit(q, *tensors))  # fmt: skip


def _descriptors_fit(*tensors: torch.Tensor) -> bool:
    """Whether the `descriptors` variant can run on these tensors: a GPU with a TMA unit
    (compute capability 9, Hopper, or later; or the interpreter), every (batch, head)'s start a
    multiple of 16 bytes, as TMA requires of a base address and its strides. Elsewhere the
    kernels keep their pointers. On a GPU, a descriptor made in a kernel lives in scratch
    memory that Triton asks its allocator for: torch's caching allocator here."""
    if not INTERPRETED:
        if torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
            return False
        triton.set_allocator(_scratch)
    starts = [(t.data_ptr(), *(s * t.element_size() for s in t.stride()[:3])) for t in tensors]
    return all(n % 16 == 0 for start in starts for n in start)  # bytes


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")  # the current device, as the launch


def _new_heads(q: torch.Tensor) -> torch.Tensor:
    """An empty (B, nh, T, hs) tensor stored as (B, T, nh, hs): merging the heads after it,
    y.transpose(1, 2).view(B, T, C), is then free."""
    B, nh, T, hs = q.shape
    return q.new_empty(B, T, nh, hs).transpose(1, 2)


def _grid(tile: str, T: int, heads: int):
    return lambda meta: (triton.cdiv(T, meta[tile]), heads)


@torch.library.custom_op("causalgpt::triton_attention", mutates_args=())
def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    seed: torch.Tensor,
    variants: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Y, LSE) of causal attention: Y (B, nh, T, hs) in q's dtype, LSE (B, nh, T) float32 (in
    log2 units with the `log2` variant)."""
    q, k, v = _dense_last(q, k, v)
    B, nh, T, hs = q.shape
    y = _new_heads(q)
    lse = torch.empty(B, nh, T, device=q.device, dtype=torch.float32)
    forward[_grid("BLOCK_M", T, B * nh)](
        q, k, v, y, lse, *_launch_args(q, k, v, y), nh, T, 1.0 / math.sqrt(hs), seed, dropout_p,
        **_constants(dropout_p, variants, q, k, v, y),
    )  # fmt: skip
    return y, lse


@_attention.register_fake
def _(q, k, v, dropout_p, seed, variants=0):
    return _new_heads(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("causalgpt::triton_attention_backward", mutates_args=())
def _attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    y: torch.Tensor,
    lse: torch.Tensor,
    dropout_p: float,
    seed: torch.Tensor,
    variants: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV from dO, the inputs, and the forward's Y and LSE."""
    do, q, k, v = _dense_last(do, q, k, v)
    B, nh, T, hs = q.shape
    d = _rowsum(do, y, variants)  # D = rowsum(dO * Y) = rowsum(P * dP), (B, nh, T)
    dq, dk, dv = _new_heads(q), _new_heads(k), _new_heads(v)
    scale, constants = 1.0 / math.sqrt(hs), _constants(dropout_p, variants, q, k, v, do, dq, dk, dv)
    constants["HALF_DIAGONAL"] = bool(variants & VARIANTS["half_diagonal"])  # the backward's own
    dk_dv_constants = {k: v for k, v in constants.items() if k != "HEAVY_FIRST"}  # KEY_DK_DV
    if variants & VARIANTS["one_launch"]:
        backward_paired[_grid("BLOCK_N", T, B * nh)](
            q, k, v, do, dq, dk, dv, lse, d, *_launch_args(q, k, v, do, dk), nh, T, scale, seed,
            dropout_p, **dk_dv_constants,
        )  # fmt: skip
        return dq, dk, dv
    backward_dk_dv[_grid("BLOCK_N", T, B * nh)](
        q, k, v, do, dk, dv, lse, d, *_launch_args(q, k, v, do, dk), nh, T, scale, seed,
        dropout_p, **dk_dv_constants,
    )  # fmt: skip
    backward_dq[_grid("BLOCK_M", T, B * nh)](
        q, k, v, do, dq, lse, d, *_launch_args(q, k, v, do, dq), nh, T, scale, seed, dropout_p,
        **constants,
    )  # fmt: skip
    return dq, dk, dv


@_attention_backward.register_fake
def _(do, q, k, v, y, lse, dropout_p, seed, variants=0):
    return _new_heads(q), _new_heads(k), _new_heads(v)


def _rowsum(do: torch.Tensor, y: torch.Tensor, variants: int) -> torch.Tensor:
    """D = rowsum(dO * Y) in float32, (B, nh, T): by `_preprocess` with the `fused_d` variant."""
    if not variants & VARIANTS["fused_d"]:
        return (do.float() * y.float()).sum(-1)
    B, nh, T, hs = do.shape
    d = torch.empty(B, nh, T, device=do.device, dtype=torch.float32)
    block = 16 if INTERPRETED else 64
    _preprocess[(triton.cdiv(T, block), B * nh)](
        y, do, d, *_launch_args(y, do), nh, T, HS=hs, BLOCK_D=max(16, triton.next_power_of_2(hs)),
        BLOCK_M=block,
    )  # fmt: skip
    return d


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, dropout_p, seed, variants = inputs
    y, lse = output
    ctx.save_for_backward(q, k, v, y, lse)
    ctx.options = (dropout_p, seed, variants)


def _backward(ctx, dy: torch.Tensor, dlse: torch.Tensor | None):
    q, k, v, y, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward(dy, q, k, v, y, lse, *ctx.options)
    return dq, dk, dv, None, None, None


_attention.register_autograd(_backward, setup_context=_setup_context)


def triton_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    seed: int | None = None,
    variants: tuple[str, ...] = (),
) -> torch.Tensor:
    """Causal attention of q, k, v (B, nh, T, hs), query i at position i: (B, nh, T, hs), equal
    to `causal_attention`'s output without storing S. `variants`: names of VARIANTS (module doc).

    `seed` fixes the dropout masks; by default one is drawn from torch's global RNG (only when
    dropout_p > 0, so reseeding torch reproduces them, as with F.dropout). It stays a tensor on
    the device: no host sync, and no graph break under torch.compile.
    """
    if seed is not None:
        seeds = torch.full((1,), seed, dtype=torch.int64, device=q.device)
    elif dropout_p > 0:
        seeds = torch.randint(2**31 - 1, (1,), device=q.device)
    else:  # unused, and torch's RNG untouched
        seeds = torch.zeros(1, dtype=torch.int64, device=q.device)
    y, _ = _attention(q, k, v, dropout_p, seeds, sum(VARIANTS[name] for name in set(variants)))
    return y
