"""Sample from a trained causalgpt: `python sample.py [key=value ...]` (see configs/sample.yaml)."""

import sys

from omegaconf import DictConfig

from base.errors import hydra_main


@hydra_main("sample")
def sample(cfg: DictConfig) -> None:
    from inference.cli import main  # once Hydra has checked the config: see train.py

    sys.exit(main(cfg))


if __name__ == "__main__":
    sample()
