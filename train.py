"""Train a GPT: `python train.py [key=value ...]` (see configs/train.yaml and the README)."""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from base.errors import user_errors
from core.checkpoint import CheckpointError
from core.run_lock import acquire_run_lock
from trainer.cli import run_config
from trainer.distributed import DistInfo
from trainer.loop import Trainer, TrainingError, TrainingInterrupted


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    with user_errors():
        settings, resolved = run_config(cfg)
        run_dir = HydraConfig.get().runtime.output_dir
        if DistInfo.from_env().is_main:  # one owner per run dir: rank 0, for the whole job
            acquire_run_lock(run_dir)
        trainer = Trainer(settings, run_dir, resolved)
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
