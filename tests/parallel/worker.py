"""A torchrun worker for the tests: trains like train.py, and can die or record logits.

    python -m torch.distributed.run ... worker.py RUN_DIR [--die-at-step K] [--logits FILE]
        [overrides ...]

--die-at-step K: rank 1 exits abruptly (os._exit(1), no cleanup) as step K begins.
--logits FILE: after training, rank 0 saves the model's logits on a fixed input to FILE (every
rank runs the forward: under FSDP it is a collective).
"""

from __future__ import annotations

import argparse
import os

import torch

from tests.trainer.helpers import make_trainer

PROBE = torch.arange(64).reshape(2, 32) * 97 % 50257  # fixed tokens, block_size 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--die-at-step", type=int)
    parser.add_argument("--logits")
    args, overrides = parser.parse_known_args()
    trainer = make_trainer(args.run_dir, [], *overrides)
    rank = trainer.dist.rank

    if args.die_at_step is not None:
        train_step = trainer.train_step

        def dying_train_step():
            if rank == 1 and trainer.state.step + 1 == args.die_at_step:
                os._exit(1)
            return train_step()

        trainer.train_step = dying_train_step

    if args.logits:
        finish = trainer._finish

        def finish_and_record():
            summary = finish()
            with torch.no_grad():
                logits = trainer.model(PROBE)[0]
            if rank == 0:
                torch.save(logits, args.logits)
            return summary

        trainer._finish = finish_and_record
    trainer.run()


if __name__ == "__main__":
    main()
