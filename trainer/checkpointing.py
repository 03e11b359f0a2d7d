"""Saving and resuming a run: one component over the objects that hold its state.

A run's checkpoints live in <run dir>/checkpoints: `last` (the weights and every stateful
object's state, all a resumed run needs to continue exactly where it stopped), `best` (the
weights at the lowest validation loss) and, with train.keep_checkpoints=N, `step-<step>` copies
of `last`. As torchtitan's CheckpointManager, it knows nothing of training: the trainer hands it
named (get, set) functions of its states, saved under those names (the keys of a checkpoint's
trainer_state).

Under torchrun every rank calls `save` at the same step (FSDP gathers the shards); rank 0 writes,
and a barrier holds the others until the checkpoint is complete. With parallel.checkpoint=sharded
nothing is gathered: every rank writes its own rows (checkpoints/sharded.py).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from base.files import link_files, write_dir_atomic
from checkpoints import store
from checkpoints.store import Checkpoint, CheckpointError
from data.pipeline import PreparedData
from hardware.distributed import DistInfo, barrier, from_main, full_model, gathered
from model import GPT, GPTConfig
from trainer.reporting import format_bytes

Stateful = dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]  # name: (get, set)


@dataclass
class CheckpointManager:
    run_dir: Path
    resolved_config: dict[str, Any]
    data: PreparedData
    keep: int
    dist: DistInfo
    say: Callable[[str], None]
    sharded: bool = False  # parallel.checkpoint=sharded: checkpoints/sharded.py

    def __post_init__(self) -> None:
        self.dir = self.run_dir / "checkpoints"
        # the token files' digests, which a resumed run's data must have (meta.data_sha256)
        self.data_sha256 = {k: v["sha256"] for k, v in self.data.meta["splits"].items()}
        self.disk_reported = False  # the first full checkpoint's size is printed once
        if self.dist.is_main:  # fail now, not at the first checkpoint
            store.check_writable(self.dir)

    def resume_checkpoint(self, resume: str | None, config: GPTConfig) -> Checkpoint | None:
        """The checkpoint `train.resume` names, if any, checked against this run's model and
        tokenizer (every rank reads it: the run dir must be on a filesystem all nodes share)."""
        source = store.resume_source(resume, self.run_dir)
        if source is None:
            return None
        ckpt = store.load_checkpoint(source, with_trainer_state=True)
        self._refuse_changed(ckpt, config)
        return ckpt

    def _refuse_changed(self, ckpt: Checkpoint, config: GPTConfig) -> None:
        """A resumed run keeps its model, its tokenizer and its data's bytes."""
        source = ckpt.path
        if ckpt.model.config != config:
            raise CheckpointError(
                f"the checkpoint at {source} has model {ckpt.model.config.to_dict()}, but this "
                f"run's model is {config.to_dict()}; resume with the same model config"
            )
        if not ckpt.same_tokenizer(self.data):
            raise CheckpointError(
                f"the checkpoint at {source} was trained with another {ckpt.tokenizer_name} "
                f"tokenizer than this run's data ({self.data.tokenizer_name} in {self.data.dir}; "
                "a trained one changes with its training text); resume with the same data"
            )
        saved = ckpt.meta.get("data_sha256")  # None: a checkpoint from before it was recorded
        if saved is not None and saved != self.data_sha256:
            saved = saved if isinstance(saved, dict) else {}
            changed = [s for s, digest in self.data_sha256.items() if saved.get(s) != digest]
            raise CheckpointError(
                f"the {' and '.join(changed)} split of this run's data ({self.data.dir}) is not "
                f"what the checkpoint at {source} was trained on: its files changed since; a "
                "resumed run keeps its data: restore them, or start a new run from these "
                f"weights with train.init_from={source}"
            )

    def restore(self, ckpt: Checkpoint, stateful: Stateful) -> None:
        """Every state but the weights (loaded before FSDP shards the model). A state the
        checkpoint lacks (no GPU's RNG, no loss scaler when it was saved) is left as it is."""
        for name, (_, load) in stateful.items():
            if ckpt.trainer_state.get(name) is not None:
                load(ckpt.trainer_state[name])

    def best_loss(self) -> float:
        """The validation loss recorded by this run's complete `best` checkpoint (inf if none):
        a kill after a `best` write and before the next `last` leaves a `best` that `last`'s
        state does not know, and a worse model must not replace it."""
        try:
            return float(store.read_config(self.dir / "best")["meta"]["val_loss"])
        except (OSError, KeyError, TypeError, ValueError):  # CheckpointError is a ValueError
            return math.inf

    def save(self, name: str, model: GPT, meta: dict[str, Any], stateful: Stateful | None) -> Path:
        """`name` with the weights, and with every stateful object's state unless None. Whole:
        gathered to rank 0, which writes; sharded: every rank writes its rows (_write_shards)."""
        path = self.dir / name
        states = None if stateful is None else {k: get() for k, (get, _) in stateful.items()}
        if self.sharded:
            weights, (states, write_shards) = model, self._shards(model, states)
        else:
            weights, write_shards = full_model(model), None
        if self.dist.is_main:
            store.save_checkpoint(
                path, weights, self.resolved_config, meta, states, self.data.tokenizer_file,
                write_shards,
            )  # fmt: skip
            if states is not None and not self.disk_reported:
                self._report_disk(path, model)
        elif write_shards is not None:
            write_shards(None)
        barrier(slow=True)  # a large checkpoint on slow storage outlasts parallel.timeout_s
        return path

    def _shards(
        self, model: GPT, states: dict[str, Any] | None
    ) -> tuple[dict[str, Any] | None, Callable[[Path | None], dict[str, Any]]]:
        """The weights and the optimizer's moments go to the shards; `states` keeps the rest
        (trainer.pt's), the moments replaced by their names; and the shards' writer."""
        from checkpoints import sharded  # sharded checkpoints only

        trees = {"model": model.stored_state()}
        if states is not None:
            trees["optimizer"] = states["optimizer"]
        mine, entries, trees = sharded.split(trees, self.dist.rank, self.dist.world_size)
        states = None if states is None else {**states, "optimizer": trees["optimizer"]}
        return states, partial(self._write_shards, mine=mine, entries=entries)

    def _write_shards(
        self, tmp: Path | None, mine: dict[str, Any], entries: dict[str, Any]
    ) -> dict[str, Any]:
        """Every rank at once: its rows into the directory rank 0 is filling (`tmp` on rank 0,
        None on the others), hashed by the rank that wrote them; then rank 0 writes shards.json.
        Returns the manifest entries of every rank's file."""
        from checkpoints import sharded  # sharded checkpoints only

        tmp = Path(from_main(tmp and str(tmp), slow=True))
        file = sharded.write_shard(tmp, self.dist.rank, self.dist.world_size, mine)
        hashed = {} if file is None else {file: store.manifest_entry(tmp / file)}
        every = gathered((hashed, entries))
        if self.dist.is_main:
            index = sharded.merged(self.dist.world_size, [entries for _, entries in every])
            (tmp / store.SHARDS_FILE).write_text(json.dumps(index))
        return {name: entry for files, _ in every for name, entry in files.items()}

    def save_periodic(self, model: GPT, meta: dict[str, Any], stateful: Stateful):
        """`last`, and with keep=N a `step-<step>` checkpoint too, pruned to the N most recently
        written: `last`'s files, hard-linked (a checkpoint's files are never changed in place,
        only replaced whole), so the state is serialized and written once."""
        last = self.save("last", model, meta, stateful)
        if self.keep and self.dist.is_main:
            name = f"{store.STEP_PREFIX}{meta['step']}"
            write_dir_atomic(self.dir / name, lambda tmp: link_files(last, tmp))
            store.prune_step_checkpoints(self.dir, self.keep, newest=name)

    def _report_disk(self, path: Path, model: GPT) -> None:
        """What this run's checkpoints will take on disk: `last` and N step checkpoints in
        full, `best` without the optimizer state."""
        self.disk_reported = True
        full = store.checkpoint_bytes(path)
        weights = sum(t.numel() * t.element_size() for t in model.stored_state().values())
        total = full * (1 + self.keep) + weights
        self.say(
            f"checkpoints: {format_bytes(full)} each; last + {self.keep} step checkpoints "
            f"(train.keep_checkpoints) + best's weights: about {format_bytes(total)} in "
            f"{self.dir} ({format_bytes(shutil.disk_usage(self.dir).free)} free)"
        )
