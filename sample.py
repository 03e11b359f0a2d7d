"""Sample from a trained causalgpt: `python sample.py [key=value ...]` (see configs/sample.yaml)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # importable from any directory

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from inference.cli import main  # noqa: E402


@hydra.main(config_path="configs", config_name="sample", version_base=None)
def sample(cfg: DictConfig) -> None:
    sys.exit(main(cfg))


if __name__ == "__main__":
    sample()
