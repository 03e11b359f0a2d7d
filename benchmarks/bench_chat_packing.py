"""Packed or padded chat SFT: what one conversation per padded row would cost instead.

Run: ``python benchmarks/bench_chat_packing.py [train.py data overrides] [--blocks 128 256 512]``
(default ``data=chat_plays``; e.g. ``data=chat data.train_files=[chats.jsonl]``). Chat SFT packs
its windows (data/loader.py, docs/chat.md); this prints, for the training split's
conversations in the chat template, what padding each to a row of block_size would waste
(positions of padding in the rows), how many conversations a row would cut, and the tokens cut.
The template's lengths depend on the data alone: any CPU gives the same table.
"""

from __future__ import annotations

import argparse

import numpy as np
from harness import head, row, train_config

from data.chat import problem, render
from data.pipeline import data_tokenizer, prepare_data, resolve_config
from data.sources import get_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[128, 256, 512])
    args, overrides = parser.parse_known_args()
    _, resolved = train_config(overrides or ["data=chat_plays"])
    cfg = resolve_config(resolved["data"])
    data = prepare_data(cfg, verbose=False)  # the tokenizer (a trained one's file) and checks
    tokenizer = data_tokenizer(data.tokenizer_name, data.dir, chat=True)
    conversations = get_source(cfg).load(cfg)["train"]["messages"]
    lengths = np.array(
        [
            len(render(c, tokenizer, generation_prompt=False)[0])
            for c in conversations
            if not problem(c)
        ]
    )
    mask = data.mask("train")
    print(
        f"{cfg['name']}/train: {len(lengths):,} conversations, {lengths.sum():,} tokens (mean "
        f"{lengths.mean():.0f}, median {np.median(lengths):.0f}, 90th percentile "
        f"{np.percentile(lengths, 90):.0f}); {mask.mean():.1%} of them are assistant targets"
    )
    head("block_size | rows wasted on padding | conversations truncated | tokens truncated", "rrrr")
    for block in args.blocks:
        kept = np.minimum(lengths, block)
        row([
            str(block), f"{1 - kept.sum() / (len(lengths) * block):.1%}",
            f"{(lengths > block).mean():.1%}", f"{1 - kept.sum() / lengths.sum():.1%}",
        ])  # fmt: skip


if __name__ == "__main__":
    main()
