"""Chat fine-tuning (experiment=chat_sft): a base run grows the template's two token rows, trains
on assistant tokens alone, records its template, resumes exactly, and reports the held-out
assistant loss. Resuming mid-SFT bit-identically: tests/trainer/test_loop.py."""

from __future__ import annotations

import torch

from checkpoints.store import load_checkpoint
from data.chat import IM_END, IM_START
from data.loader import eval_tokens
from tests.conftest import losses, make_trainer

SFT = ("experiment=chat_sft", "model.block_size=32", "optim.lr=3e-3", "optim.warmup_steps=2")


def test_a_base_run_grows_the_template_rows_as_the_mean_of_its_rows(
    tmp_path, trained_run, chat_corpus
):
    base = load_checkpoint(trained_run / "checkpoints" / "last").model
    trainer = make_trainer(tmp_path, chat_corpus, *SFT, f"train.init_from={trained_run}")
    old, new = base.transformer.wte.weight, trainer.model.transformer.wte.weight
    assert (old.shape[0], new.shape[0]) == (
        50257,
        50259,
    ) and trainer.model.config.vocab_size == 50259
    assert torch.equal(new[:50257], old)
    mean = old.mean(dim=0)
    assert torch.allclose(new[50257], mean) and torch.allclose(new[50258], mean)
    assert trainer.model.lm_head.weight is trainer.model.transformer.wte.weight  # still tied

    summary = trainer.run()
    ckpt = load_checkpoint(summary["checkpoint"])
    assert ckpt.chat_template == "chatml" and ckpt.meta["causality"]  # guarded, and recorded
    tokenizer = ckpt.tokenizer()
    assert tokenizer.encode_single_token(IM_START) == 50257
    assert tokenizer.encode_single_token(IM_END) == 50258
    # the final evaluation scored the held-out assistant tokens, every one of them once
    val = trainer.data.tokens("val")
    assert summary["val_tokens"] == eval_tokens(len(val), 32, mask=trainer.data.mask("val"))
    assert 0 < summary["val_tokens"] < len(val) - 1
    metrics = losses(trainer)
    assert metrics[12] < metrics[1]


def test_a_chat_checkpoint_is_fine_tuned_without_growing_again(tmp_path, trained_run, chat_corpus):
    first = make_trainer(tmp_path / "a", chat_corpus, *SFT, f"train.init_from={trained_run}")
    first.run()
    again = make_trainer(tmp_path / "b", chat_corpus, *SFT, f"train.init_from={tmp_path / 'a'}")
    assert torch.equal(again.model.transformer.wte.weight, first.model.transformer.wte.weight)
