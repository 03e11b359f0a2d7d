"""Sample from a trained causalgpt: `python sample.py [key=value ...]` (see configs/sample.yaml)."""

import sys

import hydra
from omegaconf import DictConfig

from inference.cli import main


@hydra.main(config_path="configs", config_name="sample", version_base=None)
def sample(cfg: DictConfig) -> None:
    sys.exit(main(cfg))


if __name__ == "__main__":
    sample()
