"""Chat fine-tuning (experiment=chat_sft): a base run grows the template's two token rows, trains
on assistant tokens alone, records its template, resumes exactly, and reports the held-out
assistant loss."""

from __future__ import annotations

import pytest
import torch

from checkpoints.store import load_checkpoint
from data.chat import IM_END, IM_START
from data.loader import eval_tokens
from tests.conftest import losses, make_trainer
from tests.trainer.test_loop import Crash, crash_at

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


def test_chat_sft_resumes_exactly(tmp_path, trained_run, chat_corpus):
    overrides = (*SFT, f"train.init_from={trained_run}")
    straight = make_trainer(tmp_path / "a", chat_corpus, *overrides)
    straight.run()
    crashed = make_trainer(tmp_path / "b", chat_corpus, *overrides)
    crash_at(crashed, 9)  # the last checkpoint was written after step 6
    with pytest.raises(Crash):
        crashed.run()
    resumed = make_trainer(tmp_path / "b", chat_corpus, *overrides, "train.resume=auto")
    assert resumed.state.step == 6
    resumed.run()
    assert {s: losses(resumed)[s] for s in range(7, 13)} == {
        s: losses(straight)[s] for s in range(7, 13)
    }  # bit-identical
