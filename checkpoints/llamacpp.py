"""`python export.py format=gguf out=model.gguf`: a model as one GGUF file, llama.cpp's format
(also Ollama's and LM Studio's), written with gguf-py, the library llama.cpp publishes.

The file is the Hugging Face export (checkpoints/export.hf_files: the same architecture check,
weights, hyperparameters and tokenizer) in llama.cpp's layout, as llama.cpp's
convert_hf_to_gguf.py writes one, without the two things that converter loses: the feed-forward
width of a GPT-2 with mlp_ratio != 4 (it writes 4 * n_embd) and any tokenizer but GPT-2's (it
knows a vocabulary only by the hash of the ids it gives on a fixed text, so no trained one
passes). What llama.cpp reads, checked against a llama.cpp build by scripts/llamacpp_check.sh:

    general.architecture       gpt2 (GPT-2's architecture) or llama (rope + rmsnorm + swiglu)
    <arch>.*                   the config.json values (HPARAMS): context length, widths, eps, rope
    tensors                    gguf-py's names for the Hugging Face ones, in gguf.dtype
    tokenizer.chat_template    a chat model's template (data/chat.py), <|im_end|> its eot
    tokenizer.ggml.*           llama.cpp's byte-level BPE ("gpt2"): tokens, merges, the
                               pre-tokenizer that splits text as our pattern, <|endoftext|> as
                               bos, eos and eot, and no bos added before a prompt
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import tiktoken
import torch
from tiktoken_ext.openai_public import r50k_pat_str

from base.errors import ConfigError
from checkpoints.hf import CONV1D_WEIGHTS
from data.chat import CHAT_TEMPLATE, IM_END
from data.tokenizer import ENDOFTEXT, PATTERN

# gguf.dtype: the matrices' torch dtype, GGML type and the file type llama.cpp reports
DTYPES = dict(
    float32=(torch.float32, gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    float16=(torch.float16, gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    bfloat16=(torch.bfloat16, gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
)
# llama.cpp's pre-tokenizer (src/llama-vocab.cpp) whose regex splits text as each of our
# patterns: GPT-2's (gpt2) and GPT-4's (bytes, bpe-<N>). llama-bpe, as tiktoken, takes a chunk
# that is a token whole before any merge.
PRE_TOKENIZERS = {r50k_pat_str: "gpt-2", PATTERN: "llama-bpe"}
# The hyperparameters llama.cpp reads, "<arch>.<key>", from the export's config.json keys
HPARAMS = dict(
    gpt2={
        "context_length": "n_positions",
        "embedding_length": "n_embd",
        "feed_forward_length": "n_inner",
        "block_count": "n_layer",
        "attention.head_count": "n_head",
        "attention.layer_norm_epsilon": "layer_norm_epsilon",
    },
    llama={
        "context_length": "max_position_embeddings",
        "embedding_length": "hidden_size",
        "feed_forward_length": "intermediate_size",
        "block_count": "num_hidden_layers",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "attention.layer_norm_rms_epsilon": "rms_norm_eps",
        "rope.freq_base": "rope_theta",
        "rope.dimension_count": "head_dim",
    },
)
QK = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")


def gguf_writer(files: dict[str, Any], tokenizer: tiktoken.Encoding, dtype: str) -> gguf.GGUFWriter:
    """The GGUF of a Hugging Face export's `files` (export.hf_files), held in memory: nothing is
    written until write_gguf, so a refusal leaves no file."""
    config = files["config.json"]
    kind = config["model_type"]
    writer = gguf.GGUFWriter(None, kind)
    writer.add_file_type(DTYPES[dtype][2])
    for key, hf_key in HPARAMS[kind].items():  # llama.cpp reads each in one type
        floating = key.endswith(("epsilon", "freq_base"))  # rope_base=500 is a float too
        (writer.add_float32 if floating else writer.add_uint32)(f"{kind}.{key}", config[hf_key])
    _add_tokenizer(writer, files["tokenizer.json"]["model"], tokenizer)
    layers = config[HPARAMS[kind]["block_count"]]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[kind.upper()], layers)
    for name, w in files["model.safetensors"].items():
        if name.endswith(CONV1D_WEIGHTS):  # Conv1D's (in, out) back to our Linear's (out, in)
            w = w.t()
        elif name.endswith(QK):
            w = _adjacent_pairs(w, config["num_attention_heads"])
        # vectors (norms' gains, biases) stay float32, as llama.cpp's converter keeps them
        torch_dtype, ggml_type, _ = DTYPES["float32" if w.dim() == 1 else dtype]
        w = w.to(torch_dtype).contiguous()
        data = w.view(torch.int16) if torch_dtype == torch.bfloat16 else w  # numpy: no bf16
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(gguf_name, data.numpy(), raw_dtype=ggml_type)
    return writer


def write_gguf(writer: gguf.GGUFWriter, path: Path) -> None:
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _adjacent_pairs(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """W_Q's or W_K's rows (or bias) for llama.cpp's llama, which rotates the pairs (2i, 2i+1)
    of each head where we (and Hugging Face's Llama) rotate (i, i + head_size/2): each head's
    row i moves to 2i, row i + head_size/2 to 2i + 1 (convert_hf_to_gguf's permute). q.k sums
    over the dimensions in any order, so q and k reordered alike give the same attention."""
    heads = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return heads.transpose(1, 2).reshape(w.shape)


def _add_tokenizer(
    writer: gguf.GGUFWriter, model: dict[str, Any], tokenizer: tiktoken.Encoding
) -> None:
    """tokenizer.json's BPE `model` (vocab and merges) as llama.cpp's byte-level BPE."""
    vocab, eot = model["vocab"], tokenizer.eot_token
    pre = PRE_TOKENIZERS.get(tokenizer._pat_str)
    if pre is None or sorted(vocab.values()) != list(range(tokenizer.n_vocab)):
        raise ConfigError(
            f"tokenizer {tokenizer.name} has no llama.cpp equivalent (a pre-tokenizer that "
            "splits text as it does, a token for every id): GGUF export supports gpt2, bytes "
            "and bpe-<N>"
        )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(sorted(vocab, key=vocab.get))
    types = [gguf.TokenType.NORMAL] * tokenizer.n_vocab
    for token in tokenizer.special_tokens_set:  # <|endoftext|>, and a chat template's two
        types[tokenizer.encode_single_token(token)] = gguf.TokenType.CONTROL
    writer.add_token_types(types)
    # llama.cpp refuses a BPE without merges (bytes has none): one that never applies, as its
    # BPE starts from single characters and no merge makes <|endoftext|>
    writer.add_token_merges(model["merges"] or [f"{ENDOFTEXT} {ENDOFTEXT}"])
    chat = IM_END in tokenizer.special_tokens_set  # a chat model: its turns end at <|im_end|>
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(eot)
    writer.add_eot_token_id(tokenizer.encode_single_token(IM_END) if chat else eot)
    writer.add_add_bos_token(False)  # else llama.cpp puts <|endoftext|> before every prompt
    if chat:
        writer.add_chat_template(CHAT_TEMPLATE)
