"""A picture of causal attention: the probabilities S of one layer, one heatmap per head.

Row i of S is how query token i spreads its attention over key tokens j; causality makes every
cell above the diagonal exactly zero. Those cells are drawn hatched, not coloured as 0, so the
mask is visible as a mask rather than as "attention that happened to be small".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tiktoken
import torch

from base.errors import ConfigError
from model import GPT

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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
    return model.attention_probs(idx[:1])[layer, 0].float().cpu()


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
    from matplotlib.patches import Rectangle

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
        # Hatching behind the transparent masked cells marks the future as "not allowed".
        ax.add_patch(
            Rectangle((-0.5, -0.5), T, T, fc="white", ec="0.75", hatch="////", lw=0, zorder=0)
        )
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
