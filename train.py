"""Train a GPT: `python train.py [key=value ...]` (see configs/train.yaml and the README)."""

import sys

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from base.errors import hydra_main, user_errors


@hydra_main("train")
def main(cfg: DictConfig) -> None:
    # Imported once Hydra has composed the config: a mistyped key or group is reported before
    # torch and the trainer load.
    from checkpoints.store import CheckpointError
    from hardware.distributed import DistInfo
    from trainer.config import removed_if_failed, run_config, write_run_files
    from trainer.loop import Trainer, TrainingError, TrainingInterrupted
    from trainer.preflight import acquire_run_lock

    hydra_cfg = HydraConfig.get()
    run_dir, overrides = hydra_cfg.runtime.output_dir, list(hydra_cfg.overrides.task)
    owner = DistInfo.from_env().is_main  # one owner per run dir: rank 0, for the whole job
    # A mistake in the config or the data is one `error:` line, and removes the run dir Hydra
    # made for it; a bug shows its traceback (and removes it too).
    with user_errors(), removed_if_failed(owner):
        settings, resolved = run_config(cfg, run_dir, overrides)  # validated, once
        # Nothing has been written to the run dir yet: take the lock on it now. The Trainer
        # repairs, checks and resumes what is there.
        if owner:
            acquire_run_lock(run_dir)
        trainer = Trainer(settings, run_dir, resolved)
    if trainer.dist.is_main:  # only now: a failed or refused attempt leaves a run's files alone
        write_run_files(run_dir, resolved, overrides, hydra_cfg, settings.train.resume == "auto")
    try:
        trainer.run()
    except TrainingInterrupted as e:
        print(str(e), file=sys.stderr)
        sys.exit(128 + e.signum)
    except (TrainingError, CheckpointError) as e:  # a non-finite loss; a full disk
        sys.exit(f"error: {e}")  # to stderr, exit code 1


if __name__ == "__main__":
    main()
