"""Train a GPT: `python train.py [key=value ...]` (see configs/train.yaml and the README)."""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from base.errors import user_errors
from core.checkpoint import CheckpointError
from trainer.cli import run_config
from trainer.loop import Trainer, TrainingError, TrainingInterrupted


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    with user_errors():
        settings, resolved = run_config(cfg)
        trainer = Trainer(settings, HydraConfig.get().runtime.output_dir, resolved)
    try:
        trainer.run()
    except TrainingInterrupted as e:
        print(str(e), file=sys.stderr)
        sys.exit(128 + e.signum)
    except (TrainingError, CheckpointError) as e:  # a non-finite loss; a full disk
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
