"""Benchmark: train bpe-8192 and bpe-32768 on >= 100 MB of text, ours against Hugging Face
`tokenizers`; print a markdown table.

Run from the repository root:
``python benchmarks/bench_bpe.py [--text shakespeare|code] [--mb 100] [--ours-mb MB]``.

The text is made locally. ``shakespeare``: the 34 training plays of the embedded Shakespeare,
repeated until ``--mb`` MB, each copy with its paragraphs shuffled (fixed seed) so the copies
differ; bytes per token are measured on the 4 held-out plays. It has few distinct chunks
(~35k), however long, so ``code`` adds text with many more, as web text has: the files this Python
installation ships (``code_text``). Both trainers see the same documents with the same
pre-tokenization (GPT-4's split pattern, byte-level). ``--ours-mb`` trains ours on a prefix of
the text instead (the table says so). Speeds are MB per CPU-second (all threads
of the process), which a loaded machine distorts less than wall time; both times are printed.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from data.bpe import PATTERN, train_bpe  # noqa: E402
from data.shakespeare import VAL_PLAYS, play_files  # noqa: E402

VOCABS = (8192, 32768)
CODE_EXTS = (".py", ".pyi", ".md", ".rst", ".txt")
DOC_BYTES = 1_000_000  # documents of ~1 MB, so neither trainer sees one 100 MB string


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def make_text(mb: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """~``mb`` MB of training documents (shuffled copies of the training plays) and the
    held-out plays."""
    plays = play_files()
    paragraphs = [
        para + "\n\n"
        for name, path in sorted(plays.items())
        if name not in VAL_PLAYS
        for para in path.read_text("utf-8").split("\n\n")
    ]
    rng = random.Random(seed)
    docs, doc, size, total = [], [], 0, 0
    while total < mb * 1e6:
        rng.shuffle(paragraphs)
        for para in paragraphs:
            doc.append(para)
            size += len(para.encode("utf-8"))
            if size >= DOC_BYTES:
                docs.append("".join(doc))
                total += size
                doc, size = [], 0
                if total >= mb * 1e6:
                    break
    held_out = [plays[name].read_text("utf-8") for name in VAL_PLAYS]
    return docs, held_out


def train_hf(docs: list[str], vocab_size: int) -> Tokenizer:
    """`tokenizers`' BPE trainer with our pre-tokenization: the 256 bytes, ``vocab_size - 1``
    tokens (as ours: ``<|endoftext|>`` is the last id)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # Oniguruma reads "{1,3}+" as a repeated "{1,3}", not a possessive one.
            pre_tokenizers.Split(Regex(PATTERN.replace("{1,3}+", "{1,3}")), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    return tok


def code_text(mb: float) -> tuple[list[str], list[str]]:
    """~``mb`` MB of training documents from the text files this Python installation ships
    (standard library and installed packages: .py, .pyi, .md, .rst, .txt), sorted by path: far
    more distinct chunks than Shakespeare, like web text. Every 20th file is held out; if the
    rest is short of ``mb``, shuffled copies of it follow."""
    roots = sorted({Path(sysconfig.get_path(k)) for k in ("stdlib", "purelib", "platlib")})
    paths = sorted(
        {p for root in roots for ext in CODE_EXTS for p in root.rglob(f"*{ext}") if p.is_file()}
    )
    texts = [p.read_text("utf-8", errors="replace") for p in paths]
    held_out = texts[::20]
    train = [t for i, t in enumerate(texts) if i % 20 and t]
    docs, total, rng = [], 0, random.Random(0)
    while total < mb * 1e6:
        for text in train:
            docs.append(text)
            total += len(text.encode("utf-8"))
            if total >= mb * 1e6:
                break
        rng.shuffle(train)
    return docs, held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="MB of training text")
    parser.add_argument("--ours-mb", type=float, default=None, help="MB for ours (a prefix)")
    parser.add_argument("--text", choices=TEXTS, default="shakespeare")
    args = parser.parse_args()
    make = TEXTS[args.text]
    docs, held_out = make(args.mb)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    ours_docs = docs if args.ours_mb is None else make(args.ours_mb)[0]
    ours_bytes = sum(len(d.encode("utf-8")) for d in ours_docs)
    held_bytes = sum(len(d.encode("utf-8")) for d in held_out)

    rows = []
    for vocab in VOCABS:
        ours_s, ours_cpu = time.perf_counter(), time.process_time()
        bpe, _ = train_bpe(ours_docs, vocab)
        ours_s, ours_cpu = time.perf_counter() - ours_s, time.process_time() - ours_cpu
        enc = bpe.encoding()
        ours_bpt = held_bytes / sum(len(enc.encode_ordinary(d)) for d in held_out)

        hf_s, hf_cpu = time.perf_counter(), time.process_time()
        tok = train_hf(docs, vocab)
        hf_s, hf_cpu = time.perf_counter() - hf_s, time.process_time() - hf_cpu
        hf_bpt = held_bytes / sum(len(e.ids) for e in tok.encode_batch(held_out))

        ours_mbs, hf_mbs = ours_bytes / 1e6 / ours_cpu, nbytes / 1e6 / hf_cpu
        rows.append(
            f"| bpe-{vocab} | {enc.n_vocab:,} / {tok.get_vocab_size() + 1:,} "
            f"| {ours_bytes / 1e6:.1f} | {ours_s:.1f} / {ours_cpu:.1f} | {ours_mbs:.2f} "
            f"| {nbytes / 1e6:.1f} | {hf_s:.1f} / {hf_cpu:.1f} | {hf_mbs:.2f} "
            f"| {hf_mbs / ours_mbs:.1f}x | {ours_bpt:.3f} / {hf_bpt:.3f} |"
        )
        print(f"bpe-{vocab} done", file=sys.stderr, flush=True)

    print(
        f"\nBPE training on {args.text} text, {cpu_name()}, {len(docs):,} documents; held-out: "
        f"{len(held_out):,} documents, {held_bytes / 1e6:.2f} MB\n"
    )
    print(
        "| tokenizer | vocab (ours / tokenizers) | ours MB | ours s (wall / CPU) "
        "| ours MB per CPU-s | tokenizers MB | tokenizers s (wall / CPU) "
        "| tokenizers MB per CPU-s | tokenizers / ours "
        "| held-out bytes/token (ours / tokenizers) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


TEXTS = {"shakespeare": make_text, "code": code_text}

if __name__ == "__main__":
    main()
