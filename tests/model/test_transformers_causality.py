"""The causality audit on code no one here wrote: transformers' own implementations, tiny random
models built from their config classes (no hub), each with the attention implementations it
offers; and negative controls, each a deliberate bug that must fail the check that covers it,
at the right layer and position."""

from __future__ import annotations

import pytest
import torch

import check_causality as check_causality_py
from base.errors import ConfigError
from checkpoints.export import export_checkpoint
from model.causality import CausalityError, assert_causal, check_causality
from tests.conftest import ROOT, save_tiny_checkpoint
from tests.model.test_check_causality import command_config, run_command

transformers = pytest.importorskip("transformers")  # a declared dev dependency; CI installs it

SIZES = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
WINDOW = 4  # shorter than the audit's 8 positions: the cache drops keys, the span check bites
ARCHITECTURES = dict(  # each config's own keys beside SIZES
    gpt2=dict(
        vocab_size=64,
        n_embd=16,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    ),
    llama={},
    mistral=dict(sliding_window=WINDOW),  # every layer windowed
    qwen2=dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    gemma2=dict(sliding_window=WINDOW, head_dim=4, query_pre_attn_scalar=4),  # local, global
    gemma3_text=dict(sliding_window=WINDOW, head_dim=4, query_pre_attn_scalar=4),
    phi3=dict(sliding_window=WINDOW, pad_token_id=0),
)
CHECKS = ["perturbation", "jacobian", "kv-cache", "attention-span", "padding", "packing"]


def tiny(name: str, attention: str = "eager") -> torch.nn.Module:
    """A random-weight transformers causal LM of architecture `name`, seeded."""
    sizes = {} if name == "gpt2" else SIZES
    config = transformers.AutoConfig.for_model(name, **sizes, **ARCHITECTURES[name])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.eval()


@pytest.mark.parametrize(
    "name, attention",
    [(n, a) for n in ARCHITECTURES for a in ("eager", "sdpa") if (n, a) != ("gemma2", "sdpa")],
)  # gemma2: eager only (transformers refuses sdpa for it)
def test_every_transformers_architecture_passes_every_check(name, attention):
    model = tiny(name, attention)
    report = check_causality(model)
    assert report.causal, str(report)
    assert [c.name for c in report.checks] == [f"{attention} {check}" for check in CHECKS]
    assert all(c.largest == 0 for c in report.checks[:2])  # the past is computed exactly as before
    assert not model.training  # put back as it was


def test_the_windows_checked_are_the_configs():
    """The span check holds each layer to its own window: all of Mistral's, Gemma 2's first of
    two (local then global), Qwen2's from max_window_layers on."""
    from model.causality import _windows

    assert _windows(tiny("mistral").config) == [WINDOW, WINDOW]
    assert _windows(tiny("gemma2").config) == [WINDOW, None]
    assert _windows(tiny("qwen2").config) == [None, WINDOW]
    assert _windows(tiny("llama").config) == [None, None]


def failed(report, check: str):
    """The named check's result, which must have failed."""
    (result,) = [c for c in report.checks if c.name.endswith(check)]
    assert not result.passed, str(report)
    return result


def test_a_causal_mask_widened_by_one_position_is_found_where_it_enters(monkeypatch):
    """transformers' mask function patched to let each query see one key ahead (eager builds
    its mask from it)."""
    monkeypatch.setattr(
        transformers.masking_utils, "causal_mask_function", lambda b, h, q, kv: kv <= q + 1
    )
    report = check_causality(tiny("llama"))
    leak = failed(report, "perturbation").leak
    assert leak.where == "layer 0 self_attn" and leak.source == leak.t + 1
    span = failed(report, "attention-span").leak
    assert span.where == "layer 0 attention (causal)" and span.source == span.t + 1
    with pytest.raises(CausalityError, match="eager perturbation: leak: layer 0 self_attn"):
        assert_causal(tiny("llama"))


def test_a_window_one_too_long_is_found(monkeypatch):
    real = transformers.masking_utils.sliding_window_overlay
    monkeypatch.setattr(
        transformers.masking_utils, "sliding_window_overlay", lambda window: real(window + 1)
    )
    leak = failed(check_causality(tiny("mistral")), "attention-span").leak
    assert leak.where == f"layer 0 attention (window {WINDOW})" and leak.t - leak.source == WINDOW


def test_a_window_one_too_short_is_found(monkeypatch):
    real = transformers.masking_utils.sliding_window_overlay
    monkeypatch.setattr(
        transformers.masking_utils, "sliding_window_overlay", lambda window: real(window - 1)
    )
    result = failed(check_causality(tiny("mistral")), "attention-span")
    assert result.leak is None
    assert result.problems[0].startswith(f"layer 0 attention (window {WINDOW}): output at t=")


def test_a_batch_run_without_its_attention_mask_is_found():
    """A forward that drops the attention mask (the batching bug of TransformerLens and
    exllama): the padded rows' outputs move from the first attention on, and so does greedy."""
    model = tiny("llama")

    def drop_mask(module, args, kwargs):
        return args, {**kwargs, "attention_mask": None}

    model.register_forward_pre_hook(drop_mask, with_kwargs=True)
    result = failed(check_causality(model), "padding")
    assert result.leak.where == "layer 0 self_attn"
    assert str(result.leak).startswith("leak: layer 0 self_attn: left-padded row 1's output at t=")


def test_a_cache_whose_positions_are_off_by_one_is_found():
    """Decoding over a cache with every new token's position one too far (rope): the cached
    outputs move from the first attention on."""
    model = tiny("llama")

    def shift_positions(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or cache.get_seq_length() == 0:
            return None
        past, T = cache.get_seq_length(), kwargs["input_ids"].size(1)
        return args, {**kwargs, "position_ids": torch.arange(past + 1, past + 1 + T)[None]}

    model.register_forward_pre_hook(shift_positions, with_kwargs=True)
    result = failed(check_causality(model), "kv-cache")
    assert result.leak.where == "layer 0 self_attn" and result.leak.source is None


def test_check_causality_py_on_a_mistral_directory_and_a_llama_export_of_ours(tmp_path, capsys):
    mistral = tmp_path / "mistral"
    tiny("mistral", "sdpa").save_pretrained(mistral)
    code, lines, summary = run_command(capsys, f"checkpoint={mistral}")
    assert code == 0 and summary["causal"], lines
    assert (
        lines[0]
        == f"causal: all 6 checks passed on the transformers mistral model in {mistral} (sdpa)"
    )
    options = dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    path, _ = save_tiny_checkpoint(tmp_path, **options)
    out = export_checkpoint({"checkpoint": str(path), "out": str(tmp_path / "llama")})
    code, lines, summary = run_command(capsys, f"checkpoint={out}")
    assert code == 0 and lines[0].startswith(
        "causal: all 6 checks passed on the transformers llama"
    )


def test_check_causality_py_refuses_an_encoder_and_our_attention_key(tmp_path):
    """Each a ConfigError, which check_causality.py prints as one `error:` line, exit code 2."""
    bert = tmp_path / "distilbert"
    config = transformers.DistilBertConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2)
    transformers.DistilBertModel(config).save_pretrained(bert)
    encoder = "holds a 'distilbert' model that transformers has no causal language model for"
    with pytest.raises(ConfigError, match=encoder):
        check_causality_py.run(command_config(f"checkpoint={bert}"))
    mistral = tmp_path / "mistral"
    tiny("mistral").save_pretrained(mistral)
    with pytest.raises(ConfigError, match="^attention=flash picks one of our implementations"):
        check_causality_py.run(command_config(f"checkpoint={mistral}", "attention=flash"))


def test_the_audit_refuses_in_one_line_what_it_cannot_drive(tmp_path):
    """BERT without is_decoder (its attention says is_causal=False) and Mamba (a recurrent
    state, no keys and values to cache): a ConfigError each, which check_causality.py prints as
    one line; BERT as a decoder is audited, and passes all but packing (below)."""
    bert = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
    bert |= dict(intermediate_size=32)
    encoder = transformers.BertLMHeadModel(transformers.BertConfig(**bert))
    with pytest.raises(
        ConfigError,
        match=r"^BertLMHeadModel cannot be audited: its attention is "
        r"not causal by design \(bert.encoder.layer.0.attention.self.is_causal",
    ):
        check_causality(encoder)
    decoder = transformers.BertLMHeadModel(transformers.BertConfig(**bert, is_decoder=True))
    assert check_causality(decoder).failures()[0].startswith("sdpa packing: leak: layer 0 ")
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2)
    mamba = tmp_path / "mamba"
    transformers.MambaForCausalLM(config).save_pretrained(mamba)
    recurrent = f"^checkpoint={mamba} holds a 'mamba' model the audit cannot check: it keeps a "
    recurrent += "recurrent state, not a cache"
    with pytest.raises(ConfigError, match=recurrent):
        check_causality_py.run(command_config(f"checkpoint={mamba}"))


def test_the_docs_opt_repro_and_the_audits_packing_check_agree():
    """docs/model.md's repro, run as it is there: OPT's packed document sees the one before it
    (Llama's does not), and the audit's packing check says the same of each, at the first
    attention."""
    doc = (ROOT / "docs" / "model.md").read_text()
    code = doc.split("A repro\n(tests/model/test_transformers_causality.py")[1]
    code = code.split("```python\n")[1].split("```")[0]
    printed = {}
    exec(compile(code, "docs/model.md", "exec"), {"print": lambda k, v: printed.update({k: v})})
    assert printed["LlamaForCausalLM"] == 0
    sizes = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    config = transformers.OPTConfig(**sizes, ffn_dim=32, word_embed_proj_dim=16)
    failures = check_causality(transformers.OPTForCausalLM(config).eval()).failures()
    leak = "sdpa packing: leak: layer 0 self_attn: packed document 1's output at t=0 differs"
    if printed["OPTForCausalLM"] > 0:  # transformers 5.24: its mask is built without them
        assert len(failures) == 1 and failures[0].startswith(leak), failures
    else:  # a transformers that reads them: the audit must pass it
        assert failures == []
