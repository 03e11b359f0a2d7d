"""Evaluation, shared by evaluate.py and training: loss and bits per byte (evals/loss.py), and
downstream tasks scored as lm-evaluation-harness scores them (evals/tasks.py)."""
