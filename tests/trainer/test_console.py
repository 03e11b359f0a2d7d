"""The progress line: each value in the unit a reader expects."""

from trainer.reporting import format_metrics


def test_tokens_per_second_are_whole_tokens_and_mfu_a_percentage():
    values = {"loss": 4.79512, "lr": 1e-4, "tok/s": 13962.4, "mfu": 0.4664}
    assert format_metrics(values) == "loss 4.795 lr 0.0001 tok/s 13,962 mfu 46.6%"
