"""The decoding layout: SplitLinear computes nn.Linear's values for any split of the rows; a
decoding copy gives the model's logits for every option, sharing everything but the Linears; it
is taken for float32 weights on a CPU (FSDP's shards: tests/parallel/test_wrapping.py); and on a
CPU, dtype=auto for generation follows a decoding probe of its own, not training's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from hardware import device
from hardware.device import SplitLinear, decodes_from_a_copy, decoding_copy
from model import GPT
from tests.conftest import tiny_config
from tests.model.conftest import ARCHITECTURES


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])  # 13 inputs: all but 1 pad the last block
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(), (1, 1), (2, 5)], ids=["vector", "one-token", "batch"])
def test_split_linear_computes_the_linear_layer(parts, bias, lead):
    torch.manual_seed(0)
    linear = nn.Linear(13, 7, bias=bias)
    x = torch.randn(*lead, 13)
    split = SplitLinear(linear, parts)
    assert split.blocks.shape == (parts, -(-13 // parts), 7)  # (parts, in rows per block, out)
    y = split(x)
    assert y.shape == (*lead, 7)
    torch.testing.assert_close(y, linear(x), atol=1e-6, rtol=1e-5)


def test_a_wrong_block_layout_shows():
    torch.manual_seed(0)
    linear = nn.Linear(12, 8)
    split = SplitLinear(linear, 2)
    x = torch.randn(3, 12)
    split.blocks = split.blocks.flip(0)  # each half of the input meets the other's rows
    assert not torch.allclose(split(x), linear(x))


def test_split_linear_is_a_detached_copy():
    linear = nn.Linear(4, 6)
    split = SplitLinear(linear, 2)
    assert not split.blocks.requires_grad
    assert split.blocks.untyped_storage().data_ptr() != linear.weight.untyped_storage().data_ptr()
    assert list(split.state_dict()) == []  # nothing of it is ever saved in a checkpoint


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_decoding_copy_gives_the_models_logits(arch):
    torch.manual_seed(0)
    model = GPT(tiny_config(**ARCHITECTURES[arch])).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    decoder = decoding_copy(model, parts=2)
    idx = torch.randint(0, 101, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(decoder(idx)[0], model(idx)[0], atol=1e-5, rtol=1e-4)
        cache, decoder_cache = model.new_kv_cache(2), decoder.new_kv_cache(2)
        model(idx[:, :11], cache=cache), decoder(idx[:, :11], cache=decoder_cache)
        torch.testing.assert_close(
            decoder(idx[:, 11:], cache=decoder_cache)[0],
            model(idx[:, 11:], cache=cache)[0],
            atol=1e-5,
            rtol=1e-4,
        )
    # the model itself is untouched: its own Linears, its own values
    assert all(type(m) is not SplitLinear for m in model.modules())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], atol=0, rtol=0)


def test_a_decoding_copy_shares_everything_but_the_linear_layers():
    model = GPT(tiny_config(tie_embeddings=True)).eval()
    decoder = decoding_copy(model, parts=2)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert "lm_head" in linears and len(linears) == 1 + 4 * model.config.n_layer
    modules = dict(decoder.named_modules())
    assert all(isinstance(modules[name], SplitLinear) for name in linears)
    assert not any(isinstance(m, nn.Linear) for m in decoder.modules())
    assert decoder.transformer.wte.weight is model.transformer.wte.weight  # shared, not copied
    assert decoder.transformer.ln_f.weight is model.transformer.ln_f.weight
    assert decoder.transformer.h[0].attn.causal_mask is model.transformer.h[0].attn.causal_mask


def test_generation_decodes_from_a_copy_only_for_float32_weights_on_a_cpu():
    model = GPT(tiny_config())
    assert decodes_from_a_copy(model)
    assert not decodes_from_a_copy(model.to(torch.bfloat16))  # nn.Linear's own path


# ----- dtype=auto for generation on a CPU: decided by a decoding probe of its own --------------


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[dict, dict]]:
    """Both probes unpinned, their cache in tmp_path, and stubbed: set the speedup each stub
    reports; each list then records one entry per probe run."""
    monkeypatch.delenv(device.AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setenv("CAUSALGPT_CACHE", str(tmp_path))
    answers = {"training": 1.0, "decoding": 1.0}
    runs: dict[str, list[float]] = {"training": [], "decoding": []}

    def stub(name: str):
        def measure(*args: object, **kwargs: object) -> float:
            runs[name].append(answers[name])
            return answers[name]

        return measure

    monkeypatch.setattr(device, "bf16_speedup", stub("training"))
    monkeypatch.setattr(device, "bf16_decoding_speedup", stub("decoding"))
    device.cpu_auto_dtype.cache_clear()
    device.cpu_decoding_dtype.cache_clear()
    yield answers, runs
    device.cpu_auto_dtype.cache_clear()
    device.cpu_decoding_dtype.cache_clear()


CPU = torch.device("cpu")


def test_generation_stays_float32_where_bf16_decodes_slower_even_if_it_trains_faster(probes):
    answers, runs = probes
    answers.update(training=2.4, decoding=0.6)  # an AMD EPYC with AVX512-BF16, as measured
    assert device.resolve_precision(CPU, "auto").dtype == torch.bfloat16  # training's autocast
    assert device.decoding_dtype("auto", CPU) == torch.float32
    assert "0.6x" in device.cpu_decoding_dtype()[1]
    assert runs == {"training": [2.4], "decoding": [0.6]}


def test_generation_picks_bfloat16_weights_where_they_decode_clearly_faster(probes):
    answers, _ = probes
    answers.update(training=0.24, decoding=1.9)
    assert device.decoding_dtype("auto", CPU) == torch.bfloat16
    why = device.cpu_decoding_dtype()[1]
    assert "1.9x" in why and "picked" in why
    # an explicit dtype is never second-guessed
    assert device.decoding_dtype("float32", CPU) == torch.float32


def test_the_decoding_probe_runs_once_per_machine_beside_the_training_probe(probes, tmp_path):
    answers, runs = probes
    answers.update(training=2.4, decoding=0.6)
    device.resolve_precision(CPU, "auto"), device.decoding_dtype("auto", CPU)
    device.cpu_auto_dtype.cache_clear(), device.cpu_decoding_dtype.cache_clear()  # a new process
    answers.update(training=0.1, decoding=5.0)  # probing again would flip both decisions
    assert device.resolve_precision(CPU, "auto").dtype == torch.bfloat16
    assert device.decoding_dtype("auto", CPU) == torch.float32
    assert runs == {"training": [2.4], "decoding": [0.6]}
    cached = json.loads((tmp_path / "cpu_precision.json").read_text())
    assert sorted(cached.values()) == [0.6, 2.4]
    assert [key.endswith("| decoding") for key in cached].count(True) == 1


def test_the_environment_pin_decides_generation_too(probes, monkeypatch):
    _, runs = probes
    monkeypatch.setenv(device.AUTO_DTYPE_ENV, "bfloat16")
    assert device.decoding_dtype("auto", CPU) == torch.bfloat16
    assert runs == {"training": [], "decoding": []}


def test_the_real_decoding_probe_measures_a_positive_ratio():
    assert device.bf16_decoding_speedup((64, 256), repeats=1) > 0
