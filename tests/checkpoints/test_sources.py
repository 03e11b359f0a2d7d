"""Model sources: GPT-2 names through the hub client (mocked at its boundary), Hugging Face GPT-2
directories, and our checkpoints all load through checkpoints.store.load_source."""

from __future__ import annotations

import huggingface_hub
import pytest
import torch
from huggingface_hub.errors import LocalEntryNotFoundError

from base.errors import ConfigError
from checkpoints.store import CheckpointError, load_source, save_checkpoint
from model import GPT
from tests.conftest import save_tiny_hf_gpt2, tiny_config

transformers = pytest.importorskip("transformers")


def logits_agree(ours, theirs, vocab: int = 50257) -> None:
    idx = torch.randint(0, vocab, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(idx)[0], theirs(idx).logits, atol=1e-4, rtol=0)


def test_a_hugging_face_directory_loads_with_gpt2s_tokenizer(tmp_path):
    theirs = save_tiny_hf_gpt2(tmp_path)
    ckpt = load_source(tmp_path, attention="sdpa")
    logits_agree(ckpt.model, theirs)
    assert ckpt.tokenizer_name == "gpt2" and ckpt.model.config.attention == "sdpa"
    assert ckpt.run_config["data"] == {"name": "shakespeare", "tokenizer": "gpt2"}


def test_pytorch_model_bin_loads_without_unpickling_code(tmp_path):
    theirs = save_tiny_hf_gpt2(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(theirs.state_dict(), tmp_path / "pytorch_model.bin")
    logits_agree(load_source(tmp_path).model, theirs)

    class Payload:  # negative control: a pickle that would run code is refused
        def __reduce__(self):
            return (exec, ("raise SystemExit('code ran')",))

    torch.save({"x": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match="(?i)weights only|unsupported|global") as info:
        load_source(tmp_path)
    assert not isinstance(info.value, SystemExit)


def test_a_gpt2_name_goes_through_the_hub_client(tmp_path, monkeypatch):
    theirs = save_tiny_hf_gpt2(tmp_path)
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    ckpt = load_source("gpt2-medium")
    logits_agree(ckpt.model, theirs)
    assert calls == [("gpt2-medium", {"allow_patterns": ["config.json", "model.safetensors"]})]
    assert ckpt.meta["source"] == "gpt2-medium" and ckpt.tokenizer_name == "gpt2"


def test_offline_without_a_cache_says_how_to_use_a_local_copy(monkeypatch):
    def offline(repo_id, **kwargs):
        raise LocalEntryNotFoundError("cannot find the requested files in the local cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConfigError, match=r"gpt2 is not in the Hugging Face cache") as info:
        load_source("gpt2")
    assert "train.init_from=/path/to/gpt2" in str(info.value)


def test_our_checkpoints_and_run_dirs_load(tmp_path, tiny_model):
    save_checkpoint(tmp_path / "run" / "checkpoints" / "best", tiny_model, {}, {"step": 3})
    ckpt = load_source(tmp_path / "run")
    assert ckpt.meta["step"] == 3
    for name, tensor in tiny_model.state_dict().items():
        assert torch.equal(ckpt.model.state_dict()[name], tensor), name


def test_other_models_and_missing_paths_are_clear_errors(tmp_path):
    llama = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "llama")
    with pytest.raises(CheckpointError, match="holds a 'llama' model"):
        load_source(tmp_path / "llama")
    save_tiny_hf_gpt2(tmp_path / "bytes", vocab_size=257)  # an export of a bytes model
    with pytest.raises(CheckpointError, match="257 tokens, fewer than its tokenizer gpt2's 50257"):
        load_source(tmp_path / "bytes").tokenizer()
    with pytest.raises(CheckpointError, match="no checkpoint found .* a GPT-2 name"):
        load_source(tmp_path / "nothing")
    weights = tmp_path / "bytes" / "model.safetensors"
    with pytest.raises(
        CheckpointError,
        match=f"is a file; a checkpoint is a directory .*: pass {tmp_path / 'bytes'};",
    ):
        load_source(weights)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_source(tmp_path / "bad")


def test_crop_block_size_keeps_the_first_positions(tmp_path):
    theirs = save_tiny_hf_gpt2(tmp_path)
    model = load_source(tmp_path).model.eval()
    model.crop_block_size(16)
    assert model.transformer.wpe.weight.shape == (16, 32) and model.config.block_size == 16
    idx = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], theirs(idx).logits, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="model.block_size=17 cannot crop"):
        model.crop_block_size(17)


def test_crop_block_size_of_a_rope_model_keeps_its_function():
    torch.manual_seed(0)
    model = GPT(tiny_config(pos_embedding="rope", norm="rmsnorm", block_size=16)).eval()
    idx = torch.randint(0, 101, (2, 8))
    with torch.no_grad():
        before = model(idx)[0]
        model.crop_block_size(8)
        torch.testing.assert_close(model(idx)[0], before)
    assert model.transformer.h[0].attn.causal_mask.shape == (8, 8)
