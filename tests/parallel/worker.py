"""A torchrun worker for the tests: trains like train.py, and can die or record logits.

    python -m torch.distributed.run ... worker.py RUN_DIR [--die-at-step K [--every-attempt]]
        [--stop-at-step K]
        [--fault checkpoint.<stage>:<n> [--fault-rank R]]
        [--logits FILE] [overrides ...]

--die-at-step K: rank 1 exits abruptly (os._exit(1), no cleanup) as step K begins, in the job's
first attempt only (torchrun's restarts, --max-restarts, run on).
--every-attempt: --die-at-step in every attempt, torchrun's restarts too: a rank that keeps dying.
--stop-at-step K: rank 0 sends torchrun (its parent) SIGTERM as step K begins, in the first
attempt only: the user's stop (Ctrl-C, kill, scancel) at an exact point.
--fault checkpoint.<stage>:<n>: rank 0 kills itself (SIGKILL) inside its n-th checkpoint write,
at that stage (tests/faults/zygote.py's `arm`), in the job's first attempt only.
--fault-rank R: the rank --fault kills instead of rank 0.
--logits FILE: after training, rank 0 saves the model's logits on a fixed input to FILE (every
rank runs the forward: under FSDP it is a collective).
--count-syncs FILE: rank 0 writes, for each step but the last, how many Python-level collectives
and host reads of tensors (truthiness, .item(), .tolist() in this project's code) happened from
the start of that step to the start of the next, as JSON {step: {what: count}}.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.conftest import ROOT, make_trainer

PROBE = torch.arange(64).reshape(2, 32) * 97 % 50257  # fixed tokens, block_size 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--die-at-step", type=int)
    parser.add_argument("--every-attempt", action="store_true")
    parser.add_argument("--stop-at-step", type=int)
    parser.add_argument("--fault")
    parser.add_argument("--fault-rank", type=int, default=0)
    parser.add_argument("--logits")
    parser.add_argument("--count-syncs")
    args, overrides = parser.parse_known_args()
    trainer = make_trainer(args.run_dir, [], *overrides)
    rank = trainer.dist.rank

    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if args.fault and first_attempt and rank == args.fault_rank:
        from tests.faults.zygote import arm

        arm(args.fault)

    train_step = trainer.train_step

    def faulty_train_step():
        dies = first_attempt or args.every_attempt
        if dies and trainer.state.step + 1 == args.die_at_step and rank == 1:
            os._exit(1)
        if first_attempt and trainer.state.step + 1 == args.stop_at_step and rank == 0:
            os.kill(os.getppid(), signal.SIGTERM)
        return train_step()

    trainer.train_step = faulty_train_step

    if args.count_syncs:
        count_syncs(trainer, Path(args.count_syncs))

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


COLLECTIVES = ("all_reduce", "broadcast", "broadcast_object_list", "all_gather", "barrier")
HOST_READS = ("__bool__", "item", "tolist")
OURS = str(ROOT)
VENV = (sys.prefix, str(Path(sys.prefix).resolve()))  # a venv may be a symlink


def count_syncs(trainer, out: Path) -> None:
    counts: collections.Counter = collections.Counter()
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*a, _name=name, _original=original, **kw):
            counts[_name] += 1
            return _original(*a, **kw)

        setattr(dist, name, counted)
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self, *a, _name=name, _original=original, **kw):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(OURS) and not caller.startswith(VENV):  # not torch's own
                counts[_name] += 1
            return _original(self, *a, **kw)

        setattr(torch.Tensor, name, read)
    per_step: dict[int, dict[str, int]] = {}
    train_step, finish = trainer.train_step, trainer._finish

    def recording_train_step():
        step = trainer.state.step
        if step:
            per_step[step] = dict(counts)
        counts.clear()
        return train_step()

    def recording_finish():
        if trainer.dist.rank == 0:
            out.write_text(json.dumps(per_step))
        return finish()

    trainer.train_step, trainer._finish = recording_train_step, recording_finish


if __name__ == "__main__":
    main()
