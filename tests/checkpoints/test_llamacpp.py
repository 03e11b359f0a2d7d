"""export.py format=gguf, read back with gguf-py's GGUFReader and checked against what llama.cpp
(commit 0c1e57098, vendored in llama-cpp-python 0.3.36) reads: its tensor names and layouts, its
keys, and its tokenizer (the pre-tokenizer regexes of src/llama-vocab.cpp and a BPE written here).
scripts/llamacpp_check.sh runs the files in llama.cpp itself."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import regex
import torch

from base.errors import ConfigError
from checkpoints import llamacpp
from checkpoints.export import export_checkpoint
from data.tokenizer import gpt2_bpe_files, load_tokenizer
from tests.conftest import TEXT, TRICKY, save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
LLAMA = {"pos_embedding": "rope", "norm": "rmsnorm", "mlp": "swiglu"}
# Whitespace runs with line breaks, one ending the text: there our pattern (GPT-4's, `\s++$`) and
# llama-bpe's regex are written differently
PROBES = [TEXT, *TRICKY, "verse  \n\n  prose\t\t \n", "line\n  "]
# Our module -> llama.cpp's tensors (src/llama-arch.cpp), a stacked one split in this order
NAMES = {
    "transformer.wte": ("token_embd",),
    "transformer.wpe": ("position_embd",),
    "transformer.ln_f": ("output_norm",),
    "lm_head": ("output",),
    "ln_1": ("attn_norm",),
    "ln_2": ("ffn_norm",),
    "attn.c_proj": ("attn_output",),
    "mlp.c_proj": ("ffn_down",),
}
GPT2_NAMES = NAMES | {"attn.c_attn": ("attn_qkv",), "mlp.c_fc": ("ffn_up",)}
LLAMA_NAMES = NAMES | {
    "attn.c_attn": ("attn_q", "attn_k", "attn_v"),
    "mlp.c_fc": ("ffn_gate", "ffn_up"),
}
# llama.cpp's regex for each pre-tokenizer (src/llama-vocab.cpp) and whether it takes a chunk
# that is a token whole (ignore_merges)
SPLITS = {
    "gpt-2": (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)", False),
    "llama-bpe": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        True,
    ),
}


def export_gguf(tmp_path, path, **cfg) -> gguf.GGUFReader:
    out = tmp_path / "model.gguf"
    export_checkpoint({"checkpoint": str(path), "out": str(out), "format": "gguf", **cfg})
    return gguf.GGUFReader(out)


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def values(tensor) -> torch.Tensor:
    """A tensor as stored, in torch's (row-major) shape: ggml's dimensions reversed."""
    shape = [int(n) for n in reversed(tensor.shape)]
    data = np.ascontiguousarray(tensor.data)
    if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:  # stored as bytes
        data = data.view(np.int16)
    tensor = torch.from_numpy(data.copy()).reshape(shape)
    return tensor.view(torch.bfloat16) if data.dtype == np.int16 else tensor


def as_llama_cpp(model, n_vocab: int) -> dict[str, torch.Tensor]:
    """Our parameters as llama.cpp lays them out: a Linear's (out, in) weight is ggml's (in, out)
    (ne0 first); GPT-2 without biases gets zero ones; llama.cpp's llama rotates the pairs
    (2i, 2i+1) of a head where we rotate (i, i + head_size/2), so its row 2i of W_Q and W_K
    is our row i and its row 2i + 1 our row i + head_size/2."""
    c = model.config
    rope = c.pos_embedding == "rope"
    half = c.head_size // 2
    heads = range(0, c.n_embd, c.head_size)
    order = [h + i + j * half for h in heads for i in range(half) for j in (0, 1)]
    ours = {}
    for name, p in model.named_parameters():
        layer, module, kind = re.fullmatch(
            r"(?:transformer\.h\.(\d+)\.)?(.+)\.(\w+)", name
        ).groups()
        p = p.detach()[:n_vocab] if module in ("transformer.wte", "lm_head") else p.detach()
        targets = (LLAMA_NAMES if rope else GPT2_NAMES)[module]
        for target, part in zip(targets, p.chunk(len(targets)), strict=True):
            part = part[order] if target in ("attn_q", "attn_k") else part
            ours[f"{'' if layer is None else f'blk.{layer}.'}{target}.{kind}"] = part
    if not rope:  # llama.cpp's gpt2 needs every bias
        for name, w in list(ours.items()):
            if "embd" not in name and name != "output.weight":
                ours.setdefault(name.replace(".weight", ".bias"), torch.zeros(w.shape[0]))
    return ours


@pytest.mark.parametrize(
    "options, tokenizer, dtype",
    [
        ({}, "bpe-300", "float32"),
        ({"bias": False, "tie_embeddings": False, "mlp_ratio": 2}, "bytes", "float32"),
        ({"vocab_size": 50304, "mlp_ratio": 3}, "gpt2", "float16"),
        (LLAMA, "bpe-300", "float32"),
        ({**LLAMA, "bias": False, "tie_embeddings": False, "rope_base": 5e2}, "bytes", "bfloat16"),
    ],
)  # fmt: skip
def test_every_tensor_is_ours(tmp_path, options, tokenizer, dtype):
    """Names, shapes and values; matrices in gguf.dtype, vectors in float32; a padded
    vocabulary (50304) cropped to the tokenizer's 50257."""
    path, model = save_tiny_checkpoint(tmp_path, tokenizer=tokenizer, **options)
    reader = export_gguf(tmp_path, path, gguf={"dtype": dtype})
    ours = as_llama_cpp(model, load_tokenizer(tokenizer, path).n_vocab)
    theirs = {t.name: t for t in reader.tensors}
    assert sorted(theirs) == sorted(ours)
    for name, tensor in theirs.items():
        want = ours[name].to(getattr(torch, dtype) if ours[name].dim() == 2 else torch.float32)
        assert torch.equal(values(tensor), want), name
    assert ("output.weight" in theirs) != model.config.tie_embeddings


@pytest.mark.parametrize("options", [{"mlp_ratio": 2}, {**LLAMA, "rope_base": 500}])
def test_the_keys_llama_cpp_reads_hold_our_values(tmp_path, options):
    path, model = save_tiny_checkpoint(tmp_path, **options)
    reader = export_gguf(tmp_path, path, gguf={"dtype": "float16"})
    c, arch = model.config, "llama" if options.get("norm") == "rmsnorm" else "gpt2"
    eps = "attention.layer_norm_rms_epsilon" if arch == "llama" else "attention.layer_norm_epsilon"
    want = {
        "general.architecture": arch,
        "general.file_type": 1,  # llama.cpp's LLAMA_FTYPE_MOSTLY_F16
        f"{arch}.context_length": c.block_size,
        f"{arch}.embedding_length": c.n_embd,
        f"{arch}.feed_forward_length": c.mlp_hidden,
        f"{arch}.block_count": c.n_layer,
        f"{arch}.attention.head_count": c.n_head,
        f"{arch}.{eps}": pytest.approx(model.transformer.ln_f.eps),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": 50256,
        "tokenizer.ggml.eos_token_id": 50256,
        "tokenizer.ggml.eot_token_id": 50256,
        "tokenizer.ggml.add_bos_token": False,
    }
    if arch == "llama":
        want |= {
            "llama.attention.head_count_kv": c.n_head,
            "llama.rope.freq_base": c.rope_base,
            "llama.rope.dimension_count": c.head_size,
        }
    assert {key: field(reader, key) for key in want} == want
    floats = [key for key in want if key.endswith(("epsilon", "freq_base"))]
    assert {reader.fields[key].types[0] for key in floats} == {gguf.GGUFValueType.FLOAT32}
    assert field(reader, "tokenizer.ggml.token_type")[50256] == 3  # CONTROL: never from text


def llama_cpp_tokenize(text: str, tokens: list[str], merges: list[str], pre: str) -> list[int]:
    """llama.cpp's BPE (llm_tokenizer_bpe_session, without special-token parsing): split with
    the pre-tokenizer's regex (the text between matches is a chunk too), spell each chunk's
    bytes as GPT-2's byte-level characters, take a chunk that is a token whole when the
    pre-tokenizer ignores merges, else merge the adjacent pair of lowest rank, leftmost first."""
    pattern, ignore_merges = SPLITS[pre]
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    ids = {token: i for i, token in enumerate(tokens)}
    ranks = {(m[: m.index(" ", 1)], m[m.index(" ", 1) + 1 :]): i for i, m in enumerate(merges)}
    bounds = [0, *(i for m in regex.finditer(pattern, text) for i in m.span()), len(text)]
    out = []
    for start, end in itertools.pairwise(bounds):
        word = "".join(char[b] for b in text[start:end].encode())
        if ignore_merges and word in ids:
            out.append(ids[word])
            continue
        symbols = list(word)
        while len(symbols) > 1:
            pairs = enumerate(itertools.pairwise(symbols))
            rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in pairs)
            if rank == len(ranks):
                break
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        out += [ids[s] for s in symbols]
    return out


@pytest.mark.parametrize(
    "name, pre", [("gpt2", "gpt-2"), ("bytes", "llama-bpe"), ("bpe-300", "llama-bpe")]
)
def test_the_tokens_and_merges_give_our_ids(tmp_path, name, pre):
    """Accents, CJK, emoji, whitespace runs and a literal <|endoftext|> (text, as llama.cpp reads
    it with --no-parse-special); bytes, which has no merges, gets one that never applies."""
    path, _ = save_tiny_checkpoint(tmp_path, tokenizer=name)
    reader = export_gguf(tmp_path, path)
    ours = load_tokenizer(name, path)
    tokens, merges = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.merges")
    assert field(reader, "tokenizer.ggml.pre") == pre and len(tokens) == ours.n_vocab
    assert (merges == ["<|endoftext|> <|endoftext|>"]) == (name == "bytes")
    if name == "gpt2":  # GPT-2's own merges.txt, exactly: 50,000 (every split of a token: 108,299)
        assert merges == gpt2_bpe_files()[1].read_text(encoding="utf-8").splitlines()[1:]
        assert len(merges) == 50_000
    for text in PROBES:
        assert llama_cpp_tokenize(text, tokens, merges, pre) == ours.encode_ordinary(text), text


def test_a_chat_models_gpt2_merges_are_gpt2s(tmp_path):
    """Issue 55 item 8: a chat model's GPT-2 tokenizer (gpt2+chatml) exported every split of a
    token (108,299 merges); it is GPT-2's own 50,000, as the base model's, plus the turns."""
    path, _ = save_tiny_checkpoint(tmp_path, {"chat_template": "chatml"}, vocab_size=50259)
    reader = export_gguf(tmp_path, path)
    merges = field(reader, "tokenizer.ggml.merges")
    assert merges == gpt2_bpe_files()[1].read_text(encoding="utf-8").splitlines()[1:]
    assert field(reader, "tokenizer.ggml.tokens")[-2:] == ["<|im_start|>", "<|im_end|>"]


def test_the_bpe_here_tells_tokenizers_apart(tmp_path):
    """Negative control: GPT-2's pre-tokenizer on a trained vocabulary, and a vocabulary without
    its merges, give other ids."""
    path, _ = save_tiny_checkpoint(tmp_path, tokenizer="bpe-300")
    reader = export_gguf(tmp_path, path)
    tokens, merges = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.merges")
    ours = load_tokenizer("bpe-300", path).encode_ordinary(TEXT)
    assert llama_cpp_tokenize(TEXT, tokens, merges, "llama-bpe") == ours
    assert llama_cpp_tokenize(TEXT, tokens, merges, "gpt-2") != ours
    assert llama_cpp_tokenize(TEXT, tokens, merges[:5], "llama-bpe") != ours


def test_a_refused_option_is_one_line_and_writes_nothing(tmp_path):
    path, _ = save_tiny_checkpoint(tmp_path, qk_norm=True)
    out = tmp_path / "model.gguf"
    command = [sys.executable, "export.py", f"checkpoint={path}", f"out={out}", "format=gguf"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: model.qk_norm=True has no equivalent in llama.cpp's")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize(
    "meta, vocab_size, command",
    [
        ({}, 50257, "llama-completion -m {out} -no-cnv -n 32 -p 'The'\n"),
        ({"chat_template": "chatml"}, 50259, "llama-cli -m {out}\n"),
    ],
)
def test_export_py_says_how_to_run_the_gguf(tmp_path, meta, vocab_size, command):
    """Issue 50 item 17: a chat model's hint was a completion of 'ROMEO:'; it is llama.cpp's chat,
    which formats the turns with the GGUF's template."""
    path, _ = save_tiny_checkpoint(tmp_path, meta, vocab_size=vocab_size)
    out = tmp_path / "model.gguf"
    command = command.format(out=out)
    args = [sys.executable, "export.py", f"checkpoint={path}", f"out={out}", "format=gguf"]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.endswith(command), result.stderr


@pytest.mark.parametrize(
    "options, named",
    [
        ({"mlp": "relu2"}, "model.mlp='relu2' has no equivalent in llama.cpp's gpt2"),
        ({"logit_softcap": 30.0}, "model.logit_softcap=30.0 has no equivalent in llama.cpp's"),
        ({"pos_embedding": "rope"}, "model.norm='layernorm' has no equivalent in llama.cpp's"),
    ],
)  # fmt: skip
def test_options_without_an_equivalent_are_named(tmp_path, options, named):
    path, _ = save_tiny_checkpoint(tmp_path, **options)
    with pytest.raises(ConfigError, match=f"^{re.escape(named)}"):
        export_gguf(tmp_path, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_tokenizer_llama_cpp_cannot_split_as_ours_is_refused(tmp_path, monkeypatch):
    path, _ = save_tiny_checkpoint(tmp_path, tokenizer="bytes")
    monkeypatch.setattr(llamacpp, "PRE_TOKENIZERS", {})
    with pytest.raises(ConfigError, match="^tokenizer bytes has no llama.cpp equivalent"):
        export_gguf(tmp_path, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_bad_keys_and_an_existing_out_are_refused(tmp_path):
    path, _ = save_tiny_checkpoint(tmp_path, tokenizer="bytes")
    with pytest.raises(ConfigError, match=r"^gguf\.dtype must be one of \[.*\], got 'int8'"):
        export_gguf(tmp_path, path, gguf={"dtype": "int8"})
    with pytest.raises(ConfigError, match=r"^format must be one of \['hf', 'gguf'\], got 'onnx'"):
        export_checkpoint({"checkpoint": str(path), "out": str(tmp_path / "x"), "format": "onnx"})
    (tmp_path / "model.gguf").write_text("keep me")
    with pytest.raises(ConfigError, match="exists; pass overwrite=true to replace it"):
        export_gguf(tmp_path, path)
    assert (tmp_path / "model.gguf").read_text() == "keep me"
    assert len(export_gguf(tmp_path, path, overwrite=True).tensors) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.gguf"]
    with pytest.raises(ConfigError, match="is a directory; format=gguf writes one file"):
        export_checkpoint({"checkpoint": str(path), "out": str(tmp_path), "format": "gguf"})
    fort = tmp_path / "fort"  # issue 55: a name without the suffix was written silently
    with pytest.raises(ConfigError, match=r"has no \.gguf suffix: give out=fort\.gguf"):
        export_checkpoint({"checkpoint": str(path), "out": str(fort), "format": "gguf"})
    assert not fort.exists()
