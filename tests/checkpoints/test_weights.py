"""The safetensors header is read without reading tensors, and its claims are checked."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from base.files import read_safetensors_header
from checkpoints.store import check_config_against_weights
from model import GPT
from tests.conftest import tiny_config


def write_raw(path, header: dict, data_bytes: int) -> None:
    """A safetensors file with this header and `data_bytes` bytes after it, written sparse
    (a 1.6 GB tensor costs no disk and no memory)."""
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + data_bytes)


def stored(model: GPT) -> dict[str, torch.Tensor]:
    """The tensors as our checkpoints store them, ready for save_file."""
    return {k: v.contiguous() for k, v in model.stored_state().items()}


def test_header_matches_what_safetensors_reads(tmp_path):
    file = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(3, 5), "b": torch.ones(7, dtype=torch.bfloat16)}, str(file))
    header = read_safetensors_header(file)
    with safe_open(str(file), "pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            tensor = f.get_tensor(name)
            assert header[name].shape == tuple(tensor.shape)
    assert header["a"].dtype == "F32" and header["b"].dtype == "BF16"


def test_a_huge_tensor_is_described_without_reading_it(tmp_path):
    """A header for GPT-2 XL's (50257, 8192) embedding over a sparse file: read in a moment,
    no memory allocated for the tensor."""
    n = 50257 * 8192 * 4
    write_raw(
        tmp_path / "big.safetensors",
        {"wte": {"dtype": "F32", "shape": [50257, 8192], "data_offsets": [0, n]}},
        n,
    )
    assert read_safetensors_header(tmp_path / "big.safetensors")["wte"].shape == (50257, 8192)


@pytest.mark.parametrize(
    "header, data_bytes, message",
    [
        # shapes claiming more bytes than their range
        (
            {"w": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 16]}},
            16,
            "invalid shape",
        ),
        # two tensors over the same bytes (loading would allocate both)
        (
            {
                "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "v": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            },
            16,
            "invalid offset",
        ),
        # a range past the end of the file
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8, "not fully covered"),
        ({"w": {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]}}, 16, "F99"),
        ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, 16, "`-4`"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, True]}}, 16, "`true`"),
        ({"w": [1, 2]}, 0, "invalid type"),
    ],
)
def test_a_lying_header_is_refused(tmp_path, header, data_bytes, message):
    write_raw(tmp_path / "m.safetensors", header, data_bytes)
    with pytest.raises(ValueError, match=message) as e:
        read_safetensors_header(tmp_path / "m.safetensors")
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"{tmp_path / 'm.safetensors'} is not a valid safetensors")


def test_a_header_length_beyond_the_file_is_refused(tmp_path):
    file = tmp_path / "m.safetensors"
    file.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="header too large"):
        read_safetensors_header(file)
    file.write_bytes(b"abc")
    with pytest.raises(ValueError, match="header too small"):
        read_safetensors_header(file)


@pytest.mark.parametrize(
    "options",
    [{}, dict(tie_embeddings=False, bias=False), dict(pos_embedding="rope", qk_norm=True)],
)
def test_the_configs_own_weights_pass(tmp_path, options):
    """Negative control for the mismatch tests below; stored_shapes costs no memory."""
    config = tiny_config(**options)
    save_file(stored(GPT(config)), str(tmp_path / "m.safetensors"))
    check_config_against_weights(config, read_safetensors_header(tmp_path / "m.safetensors"))
    big = tiny_config(n_embd=8192, n_layer=24, n_head=16, vocab_size=50257)
    assert GPT.stored_shapes(big)["transformer.wte.weight"] == (50257, 8192)  # 1.6 GB, on meta


@pytest.mark.parametrize(
    "claim, message",
    [
        (dict(n_embd=32), "model.n_embd=32 disagrees with the weights, which give n_embd=16"),
        (dict(vocab_size=100), "model.vocab_size=100 disagrees .* vocab_size=101"),
        (dict(n_layer=3), "model.n_layer=3 disagrees .* n_layer=2"),
        (dict(block_size=32), "model.block_size=32 disagrees .* block_size=16"),
        (dict(tie_embeddings=False), "model.tie_embeddings=False disagrees"),
        (dict(pos_embedding="rope"), "model.pos_embedding='rope' disagrees .*='learned'"),
        (
            dict(mlp_ratio=2),
            r"h.0.mlp.c_fc.bias the shape \(64,\), the config's model \(32,\)",
        ),
        (dict(bias=False), r"hold transformer.h.0.attn.c_attn.bias, .* \(see model.bias"),
        (dict(qk_norm=True), r"has transformer.h.0.attn.k_norm.weight, .* model.qk_norm"),
    ],
)
def test_a_claim_the_weights_contradict_names_the_key_and_both_values(tmp_path, claim, message):
    save_file(stored(GPT(tiny_config())), str(tmp_path / "m.safetensors"))
    tensors = read_safetensors_header(tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match=message) as e:
        check_config_against_weights(tiny_config(**claim), tensors)
    assert "\n" not in str(e.value)


def test_integer_weights_are_refused(tmp_path):
    sd = stored(GPT(tiny_config()))
    sd["transformer.ln_f.weight"] = sd["transformer.ln_f.weight"].to(torch.int32)
    save_file(sd, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match="ln_f.weight as I32"):
        check_config_against_weights(
            tiny_config(), read_safetensors_header(tmp_path / "m.safetensors")
        )
