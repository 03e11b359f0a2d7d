"""A picture of causal attention: the probabilities S of one layer, one heatmap per head.

Row i of S is how query token i spreads its attention over key tokens j; causality makes every
cell above the diagonal exactly zero. Those cells are drawn hatched, not coloured as 0, so the
mask is visible as a mask rather than as "attention that happened to be small".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tiktoken
import torch

from base.errors import ConfigError
from model import GPT
from model.inspection import attention_probs, formula_steps

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

ONE_SCORE = "one token has one score, and a variance needs two: give a longer text"
MAX_LABEL_CHARS = 10
MAX_TICKS = 40  # beyond this many tokens, label every k-th one


def prompt_attention(model: GPT, idx: torch.Tensor, layer: int | None = None) -> torch.Tensor:
    """S (n_head, T, T) of `layer` (default the last; negative counts from the end) for the
    first row of idx (1, T), as float32 on the CPU."""
    n_layer = model.config.n_layer
    layer = n_layer - 1 if layer is None else layer
    if isinstance(layer, bool) or not isinstance(layer, int) or not -n_layer <= layer < n_layer:
        raise ConfigError(
            f"attention_layer={layer!r} is out of range: the model has {n_layer} layers "
            f"(0 to {n_layer - 1}, or negative to count from the end)"
        )
    return attention_probs(model, idx[:1])[layer, 0].float().cpu()


def token_labels(tokenizer: tiktoken.Encoding, ids: Sequence[int]) -> list[str]:
    """Short readable tick labels: spaces as '␣', newlines as '↵', characters the default font
    lacks (emoji) as U+XXXX, a token that is part of a character (a byte tokenizer's, a split
    emoji's) as its bytes in hex, long tokens shortened."""
    labels = []
    for i in ids:
        raw = tokenizer.decode_single_token_bytes(i)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:  # one chip per byte would each read '�'
            text = raw.hex(" ").upper()
        text = text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("$", r"\$")
        text = "".join(c if ord(c) <= 0xFFFF else f"U+{ord(c):X}" for c in text)
        if len(text) > MAX_LABEL_CHARS:
            text = text[: MAX_LABEL_CHARS - 1] + "…"
        labels.append(text)
    return labels


def plot_attention(
    probs: torch.Tensor, labels: Sequence[str], path: str | Path, title: str
) -> Figure:
    """Write S (n_head, T, T) as a grid of heatmaps to `path` (format from its suffix) and
    return the figure. All heads share one 0-to-1 colour scale, so they can be compared."""
    from matplotlib import colormaps  # here: sample.py and serve.py start ~1 s sooner without
    from matplotlib.figure import Figure

    n_head, T, _ = probs.shape
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    maps = np.ma.masked_array(probs.numpy(), mask=np.broadcast_to(future, probs.shape))
    cmap = colormaps["viridis"].with_extremes(bad=(0, 0, 0, 0))  # masked cells: transparent
    ncols = min(n_head, 4)
    nrows = math.ceil(n_head / ncols)
    panel = min(max(2.5 + 0.18 * T, 3.0), 9.0)  # inches: room for the token labels
    fig = Figure(figsize=(ncols * panel + 1.2, nrows * panel + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    ticks = list(range(0, T, math.ceil(T / MAX_TICKS)))
    for h, ax in enumerate(axes.flat):
        if h >= n_head:
            ax.set_axis_off()
            continue
        _hatch(ax, T)
        image = ax.imshow(maps[h], cmap=cmap, vmin=0, vmax=1, interpolation="nearest", zorder=1)
        ax.set_title(f"head {h}", fontsize=11)
        ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=90, fontsize=8)
        ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=8)
        ax.tick_params(length=0)
        ax.spines[:].set_color("0.6")
        if h % ncols == 0:
            ax.set_ylabel("query: the token attending")
        if h + ncols >= n_head:  # no panel below this one
            ax.set_xlabel("key: the token attended to")
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention probability")
    fig.suptitle(title, fontsize=13)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, facecolor="white")
    return fig


def _hatch(ax: Axes, T: int) -> None:
    """Hatching behind the transparent masked cells of a (T, T) map marks the future as "not
    allowed"."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((-0.5, -0.5), T, T, fc="white", ec="0.75", hatch="////", lw=0, zorder=0))


def formula_view(
    model: GPT,
    idx: torch.Tensor,
    layer: int,
    head: int,
    row: int | None = None,
    names: Mapping[str, str] | None = None,
) -> dict:
    """One layer and head of the attention formula for idx (1, T), as plain numbers for the page,
    the API and sample.py formula=true, from model/inspection.py's `formula_steps` (the model's
    own lines):

    - steps: the head's matrices in the order the formula reads (Q, K, V, each option's Q and
      K, QK, scaled, masked with None where -inf, S, Y), and the layer's X, concatenated heads
      and output through W_O;
    - heads: every head's S (small multiples) and its share of the output, the norm of
      Y_h W_O[:, h]^T, its slice through W_O;
    - sqrt_dk: the variance of the raw and of the scaled scores over the visible cells, and
      the chosen row's largest weight and entropy with and without the division;
    - row (default the last): that query's dot products with the visible keys, scaled, their
      exponentials and sum, its weights, and y_i, their weighted sum of the value rows.

    A layer, head or row out of range is a ConfigError naming it as the caller's user typed it
    (`names`: e.g. sample.py's attention_layer for layer), its `key` that name."""
    name = lambda key: (names or {}).get(key, key)  # noqa: E731
    c = model.config
    if isinstance(layer, int) and -c.n_layer <= layer < 0:  # negative counts from the end
        layer += c.n_layer
    for key, value, count in (("layer", layer, c.n_layer), ("head", head, c.n_head)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
            why = f"{name(key)}={value!r} is out of range: use 0 to {count - 1}"
            raise ConfigError(why, name(key))
    T = idx.size(1)
    i = T - 1 if row is None else row
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < T:
        why = f"the text has {T} tokens (0 to {T - 1})"
        raise ConfigError(f"{name('row')}={row!r} is out of range: {why}", name("row"))
    steps = {k: v.double().cpu() for k, v in formula_steps(model, idx, layer).items()}
    w_o = model.transformer.h[layer].attn.c_proj.weight.double().cpu()  # (C, C)
    hs = c.head_size
    shares = [
        (steps["Y"][h] @ w_o[:, h * hs : (h + 1) * hs].T).norm().item() for h in range(c.n_head)
    ]
    visible = torch.ones(T, T, dtype=torch.bool).tril()
    raw, scaled = steps["QK"][head], steps["scaled"][head]

    def weights(scores: torch.Tensor) -> tuple[float, float]:  # row i's (largest, entropy)
        p = scores[i, : i + 1].softmax(-1)
        return p.max().item(), -(p * p.clamp_min(1e-300).log()).sum().item()

    (largest, entropy), (largest_unscaled, entropy_unscaled) = weights(scaled), weights(raw)
    exps = (scaled[i, : i + 1] - scaled[i, : i + 1].max()).exp()
    per_head = {k: v[head] for k, v in steps.items() if v.dim() == 3}
    per_layer = {k: v for k, v in steps.items() if v.dim() == 2 and k != "forward"}
    per_head["masked"] = per_head["masked"].masked_fill(~visible, math.nan)  # JSON: null
    return {
        "layer": layer,
        "head": head,
        "d_k": hs,
        "steps": {k: _rounded(v) for k, v in {**per_head, **per_layer}.items()},
        "heads": {"S": steps["S"].mul(1e6).round().div(1e6).tolist(), "shares": shares},
        "sqrt_dk": {  # a one-token text has one score: no variance to show
            "var_raw": raw[visible].var().item() if T > 1 else None,
            "var_scaled": scaled[visible].var().item() if T > 1 else None,
            "note": None if T > 1 else ONE_SCORE,
            "largest": largest,
            "entropy": entropy,
            "largest_unscaled": largest_unscaled,
            "entropy_unscaled": entropy_unscaled,
        },
        "row": {
            "i": i,
            "dots": raw[i, : i + 1].tolist(),
            "scaled": scaled[i, : i + 1].tolist(),
            "exps": exps.tolist(),
            "sum": exps.sum().item(),
            "weights": steps["S"][head, i, : i + 1].tolist(),
            "y": steps["Y"][head, i].tolist(),
        },
    }


def _rounded(matrix: torch.Tensor) -> list[list[float | None]]:
    """6 decimals (the page's precision), NaN (a masked cell) as None: JSON has no -inf."""
    rows = matrix.mul(1e6).round().div(1e6).tolist()
    return [[None if math.isnan(x) else x for x in r] for r in rows]


def row_lines(view: dict, labels: Sequence[str]) -> list[str]:
    """The chosen row's computation, as text: its dot products, scaled, the softmax, y_i."""
    r, d_k, i = view["row"], view["d_k"], view["row"]["i"]
    keys = " ".join(f"{labels[j]!r}" for j in range(i + 1))
    numbers = lambda xs: " ".join(f"{x:.3g}" for x in xs)  # noqa: E731
    s = view["sqrt_dk"]
    return [
        f"layer {view['layer']}, head {view['head']}, query {i} ({labels[i]!r}) over keys {keys}",
        f"q_{i} . k_j          {numbers(r['dots'])}",
        f"/ sqrt({d_k})        {numbers(r['scaled'])}",
        f"exp(. - max)       {numbers(r['exps'])}  (sum {r['sum']:.4g})",
        f"S[{i}, j] = exp/sum  {numbers(r['weights'])}",
        f"y_{i} = sum_j S[{i}, j] v_j = [{numbers(r['y'])}]",
        "why / sqrt(d_k): "
        + (s["note"] or f"score variance {s['var_raw']:.3g} raw, {s['var_scaled']:.3g} scaled")
        + f"; row {i}'s largest weight {s['largest']:.3g} (entropy {s['entropy']:.3g} nats), "
        f"without the division {s['largest_unscaled']:.3g} ({s['entropy_unscaled']:.3g} nats)",
    ]


def plot_formula(view: dict, labels: Sequence[str], path: str | Path) -> Figure:
    """Write every step of one head's formula (formula_view's) in rows that read as the formula:
    X to Q, K, V (and each option's Q and K); Q K^T, / sqrt(d_k), the mask, S; S V = Y, every
    head's Y side by side (the concatenation) and the output through W_O; then the chosen
    query's row (its weights as bars, its computation as text) and the sqrt(d_k) panel. Each
    matrix has its own colour scale and tokens on the axes (every k-th past MAX_TICKS), the
    chosen row outlined; the masked triangle is hatched (-inf, not a small number), and S's too
    (exactly 0, by the mask). The figure grows with the text: 128 tokens stay legible."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    steps, h, d_k, i = view["steps"], view["head"], view["d_k"], view["row"]["i"]
    inputs = [n for n in ("X", "Q", "K", "V", "Q_norm", "K_norm", "Q_rope", "K_rope") if n in steps]
    rows = [inputs, ["QK", "scaled", "masked", "S"], ["Y", "heads", "out"]]
    titles = dict(X="X (the layer's input, normed)", Q="Q = X W_Q", K="K = X W_K", V="V = X W_V")
    titles |= dict(Q_norm="qk_norm: Q", K_norm="qk_norm: K", Q_rope="rope: Q", K_rope="rope: K")
    titles |= dict(QK="Q K^T", scaled=f"/ sqrt({d_k})", masked="mask: -inf above", S="S = softmax")
    titles |= dict(Y="Y = S V", heads="heads side by side: [Y_0 ... Y_H-1]", out="Y W_O^T: output")
    T = len(labels)
    side = max(3.0, 6.0 * T / 128)  # inches per square step: 128 tokens get 6
    width = len(inputs) * side
    fig = Figure(figsize=(width, 3 * side + 4.5), layout="constrained")
    grid = fig.add_gridspec(4, 1, height_ratios=[side, side, side, 4])
    ticks = list(range(0, T, math.ceil(T / MAX_TICKS)))
    ticks += [i] if i not in ticks else []
    for r, names in enumerate(rows):
        axes = grid[r].subgridspec(1, len(inputs)).subplots()
        for k, ax in enumerate(np.atleast_1d(axes)):
            if k >= len(names):
                ax.set_axis_off()
                continue
            name = names[k]
            values = np.array(steps[name], dtype=float)  # None (masked) -> nan: transparent
            if name in ("masked", "S"):
                values[np.triu(np.ones((T, T), dtype=bool), k=1)] = np.nan
                _hatch(ax, T)
            image = ax.imshow(values, cmap="viridis", interpolation="nearest", aspect="auto")
            image.set_zorder(1)
            fig.colorbar(image, ax=ax, location="bottom", shrink=0.8)  # its range, in its units
            shape = f" ({values.shape[0]} x {values.shape[1]})"
            ax.set_title(titles[name] + ("" if name in rows[1] else shape), fontsize=10)
            ax.set_yticks(ticks, [labels[t] for t in ticks], fontsize=7)
            if name in rows[1]:  # keys across, as queries down
                ax.set_xticks(ticks, [labels[t] for t in ticks], rotation=90, fontsize=7)
            else:
                ax.set_xticks([])
            ax.tick_params(length=0)
            columns = values.shape[1]
            ax.add_patch(
                Rectangle((-0.5, i - 0.5), columns, 1, fill=False, ec="red", lw=1.2, zorder=2)
            )
            if name == "heads":  # each head's columns; the chosen one's band outlined
                for c in range(d_k, columns, d_k):
                    ax.axvline(c - 0.5, color="white", lw=1, zorder=2)
                band = Rectangle((h * d_k - 0.5, -0.5), d_k, T, fill=False, ec="red", lw=1.5)
                ax.add_patch(band).set_zorder(2)
    bars, text = grid[3].subgridspec(1, 2, width_ratios=[1, 1.6]).subplots()
    row = view["row"]
    bars.bar(range(i + 1), row["weights"], color="#2c7fb8")
    bars.set_title(f"S[{i}, j]: query {i} ({labels[i]!r}) over the keys it sees", fontsize=10)
    keys = [t for t in ticks if t <= i]
    bars.set_xticks(keys, [labels[t] for t in keys], rotation=90, fontsize=7)
    bars.set_xlim(-0.5, max(i, 1) + 0.5)
    text.set_axis_off()
    text.text(0, 1, "\n".join(_wrapped(row_lines(view, labels))), va="top", family="monospace",
              fontsize=8, transform=text.transAxes)  # fmt: skip
    fig.suptitle(
        f"layer {view['layer']}, head {h}: S = softmax(mask(Q K^T / sqrt(d_k))), Y = S V, "
        "out = [Y_0 ... Y_H-1] W_O^T"
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, facecolor="white")
    return fig


def _wrapped(lines: list[str], width: int = 110, most: int = 24) -> list[str]:
    """The row's text lines for the figure: long ones wrapped, at most `most` lines in all."""
    import textwrap

    out = [part for line in lines for part in textwrap.wrap(line, width, subsequent_indent="  ")]
    return (
        out if len(out) <= most else [*out[: most - 1], f"... ({len(out) - most + 1} more lines)"]
    )
