"""Chat fine-tuning (experiment=chat_sft): a base run grows the template's two token rows, trains
on assistant tokens alone, records its template, resumes exactly, and reports the held-out
assistant loss. Resuming mid-SFT bit-identically: tests/trainer/test_loop.py."""

from __future__ import annotations

import pytest
import torch

from checkpoints.store import load_checkpoint
from data.chat import IM_END, IM_START
from data.loader import eval_tokens
from evals.loss import evaluate_checkpoint
from tests.conftest import losses, make_trainer
from tests.trainer.test_trained_tokenizer import config

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
    # evaluate.py on the chat run scores the same held-out assistant tokens
    cfg = config("evaluate", f"checkpoint={summary['checkpoint']}", "device=cpu", "dtype=float32")
    result = evaluate_checkpoint(cfg)
    assert result["tokens"] == summary["val_tokens"]
    assert result["loss"] == pytest.approx(summary["val_loss"], abs=2e-4)


def test_a_chat_checkpoint_is_fine_tuned_without_growing_again(tmp_path, trained_run, chat_corpus):
    first = make_trainer(tmp_path / "a", chat_corpus, *SFT, f"train.init_from={trained_run}")
    first.run()
    again = make_trainer(tmp_path / "b", chat_corpus, *SFT, f"train.init_from={tmp_path / 'a'}")
    assert torch.equal(again.model.transformer.wte.weight, first.model.transformer.wte.weight)


def test_a_step_is_the_mean_over_all_its_assistant_tokens(tmp_path, trained_run, chat_corpus):
    """Two micro-batches holding different numbers of assistant tokens: the step's loss (and
    gradient) is their summed token losses over the total, not the mean of the two means, which
    would weigh each micro-batch's tokens differently."""
    overrides = (*SFT, f"train.init_from={trained_run}", "train.batch_size=2")
    trainer = make_trainer(tmp_path, chat_corpus, *overrides, "train.grad_accum_steps=2")
    sampler, model = trainer.sampler, trainer.model
    first = next(
        s for s in range(0, 100, 2) if 0 < sampler.targets(s) != sampler.targets(s + 1) > 0
    )
    sampler.load_state_dict({"seed": sampler.seed, "step": first})  # a step of two such halves
    counts = [sampler.targets(first), sampler.targets(first + 1)]
    sums = []
    with torch.no_grad():
        for step in (first, first + 1):
            x, y = sampler.batch_at(step)
            assert int((y != -1).sum()) == sampler.targets(step)
            sums.append(model(x, y, loss_reduction="sum")[1].item())
    expected = sum(sums) / sum(counts)
    assert abs(expected - (sums[0] / counts[0] + sums[1] / counts[1]) / 2) > 1e-3
    loss, _ = trainer.train_step()
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_the_sample_a_chat_run_records_is_a_reply(tmp_path, trained_run, chat_corpus):
    """W&B's samples of a chat run: the held-out split's first conversation up to its first
    reply, and the reply the model writes, ended at <|im_end|>."""
    trainer = make_trainer(tmp_path, chat_corpus, *SFT, f"train.init_from={trained_run}")
    [(prompt, reply)] = trainer._samples()
    assert prompt.startswith("<|im_start|>system\nThis is Julius Caesar.")
    assert (
        prompt.endswith("<|im_end|>\n<|im_start|>assistant\n") and prompt.count("<|im_start|>") == 3
    )
    assert IM_END not in reply


def test_gpt2_weights_are_chat_fine_tuned(tmp_path, hf_gpt2_dir, chat_corpus):
    """train.init_from=gpt2's path (a Hugging Face GPT-2 directory, as the hub's cache holds
    it): its 50,257 rows grow by the template's two, and a chat checkpoint comes out."""
    trainer = make_trainer(
        tmp_path, chat_corpus, *SFT, f"train.init_from={hf_gpt2_dir}", "train.max_steps=2"
    )
    assert trainer.model.config.vocab_size == 50259
    ckpt = load_checkpoint(trainer.run()["checkpoint"])
    assert ckpt.chat_template == "chatml" and ckpt.tokenizer().n_vocab == 50259


def test_a_chat_model_from_scratch(tmp_path, chat_corpus):
    """experiment=chat_sft train.init_from=null: a new model sized by the chat tokenizer."""
    trainer = make_trainer(tmp_path, chat_corpus, *SFT, "train.init_from=null", "train.max_steps=2")
    assert trainer.model.config.vocab_size == 50259
    assert load_checkpoint(trainer.run()["checkpoint"]).chat_template == "chatml"
