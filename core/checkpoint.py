"""Checkpoints: safe to load, atomic to write, verified on read.

Layout of one checkpoint directory (`<run_dir>/checkpoints/last/` or `.../best/`):

    model.safetensors   the weights (tensors only: loading them cannot run code)
    config.json         {"model": GPTConfig fields, "run": the resolved run config, "meta": {...}}
    trainer.pt          optimizer, step, RNG and data position; loaded with weights_only=True
    tokenizer.json      a trained tokenizer (data.tokenizer=bpe-<N>), so that the checkpoint
                        alone can sample and evaluate; absent for built-in tokenizers
    manifest.json       size and sha256 of each file above; written last

A checkpoint is written into a temporary sibling directory and renamed into place, so a crash at
any instant leaves either the previous complete checkpoint or the new one, never a mixture.
Directories without a valid manifest (an interrupted write) are never picked up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tiktoken
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from data.tokenizer import TOKENIZER_FILE, load_tokenizer
from model import GPT, GPTConfig

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TRAINER_FILE = "trainer.pt"
MANIFEST_FILE = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt; the message says which file and why."""


@dataclass
class Checkpoint:
    path: Path
    model: GPT
    run_config: dict[str, Any]
    meta: dict[str, Any]
    trainer_state: dict[str, Any] | None = field(default=None)

    @property
    def tokenizer_name(self) -> str:
        """The data.tokenizer the model was trained with."""
        data = self.run_config.get("data") or {}
        return self.meta.get("tokenizer") or data.get("tokenizer") or "gpt2"

    def tokenizer(self) -> tiktoken.Encoding:
        """The tokenizer the model was trained with, from the checkpoint alone (a trained one
        from its verified copy of tokenizer.json)."""
        return load_tokenizer(self.tokenizer_name, self.path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(directory: str | Path) -> None:
    """Fail at the start of a run, not at its first checkpoint, if `directory` cannot be
    written (read-only, a path through a regular file, no permission)."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        reason = "a file is in the way" if isinstance(e, FileExistsError) else e.strerror or e
        raise CheckpointError(f"cannot write checkpoints to {directory}: {reason}") from e


@contextlib.contextmanager
def _os_errors(file: Path) -> Iterator[None]:
    """Let a failed write surface as the OSError behind it. safetensors reports a full disk as
    SafetensorError("... No space left on device (os error 28)"), and torch.save into a file
    object as a RuntimeError ("unexpected pos ...") raised while handling the OSError."""
    try:
        yield
    except (SafetensorError, RuntimeError) as e:
        if isinstance(e.__context__, OSError):
            raise e.__context__ from e
        if match := re.search(r"os error (\d+)", str(e)):
            code = int(match[1])
            raise OSError(code, os.strerror(code), str(file)) from e
        raise


def model_state(model: GPT) -> dict[str, torch.Tensor]:
    """The weights to save: contiguous CPU tensors, the tied head stored once (as wte)."""
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight")
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def save_checkpoint(
    path: str | Path,
    model: GPT,
    run_config: dict[str, Any],
    meta: dict[str, Any],
    trainer_state: dict[str, Any] | None = None,
    tokenizer_file: str | Path | None = None,
) -> Path:
    """Write a complete checkpoint at `path`, replacing any previous one atomically;
    `tokenizer_file` (a trained tokenizer's file) is copied in as tokenizer.json.

    A write that fails (a read-only directory, a full disk) raises CheckpointError naming the
    path and the cause; the previous checkpoint at `path` is left as it was, and the partial
    new one is removed."""
    path = Path(path)
    try:
        _write_checkpoint(path, model, run_config, meta, trainer_state, tokenizer_file)
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint to {path}: {e.strerror or e}; {_previous(path)}"
        ) from e
    return path


def _previous(path: Path) -> str:
    """What a failed write left at `path`, for the error message."""
    try:
        recover_interrupted_swap(path)
        step = json.loads((path / CONFIG_FILE).read_text())["meta"].get("step")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "there is no previous checkpoint there"
    at = "" if step is None else f" (step {step})"
    return f"the previous checkpoint at {path}{at} is intact"


def _write_checkpoint(
    path: Path,
    model: GPT,
    run_config: dict[str, Any],
    meta: dict[str, Any],
    trainer_state: dict[str, Any] | None,
    tokenizer_file: str | Path | None = None,
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # A crash between the two renames below left the only complete checkpoint at `old`: put it
    # back before anything could delete `old`.
    recover_interrupted_swap(path)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"  # mkdir, not mkdtemp (0700): a
    tmp.mkdir()  # checkpoint follows the umask, so teammates can read it where the umask allows
    try:
        with _os_errors(tmp / MODEL_FILE):
            save_file(model_state(model), str(tmp / MODEL_FILE))
        os.chmod(tmp / MODEL_FILE, tmp.stat().st_mode & 0o666)  # safetensors makes it 0600
        config = {"model": model.config.to_dict(), "run": run_config, "meta": meta}
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        files = [MODEL_FILE, CONFIG_FILE]
        if trainer_state is not None:
            with _os_errors(tmp / TRAINER_FILE), open(tmp / TRAINER_FILE, "wb") as f:
                torch.save(trainer_state, f)
            files.append(TRAINER_FILE)
        if tokenizer_file is not None:
            with _os_errors(tmp / TOKENIZER_FILE):
                shutil.copyfile(tokenizer_file, tmp / TOKENIZER_FILE)
            files.append(TOKENIZER_FILE)
        manifest = {
            name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
            for name in files
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
        for name in [*files, MANIFEST_FILE]:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        # Swap: move the old checkpoint aside, rename the new one in, then delete the old one.
        # At every instant either `path` or `old` holds a complete checkpoint.
        old = path.parent / f".{path.name}.old"
        if old.exists():  # `path` exists (recovered above): `old` is a leftover copy
            shutil.rmtree(old)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def recover_interrupted_swap(path: Path) -> None:
    """If a crash came between moving the old checkpoint aside and renaming the new one in,
    put the old one back."""
    old = path.parent / f".{path.name}.old"
    if not path.exists() and old.exists():
        os.replace(old, path)


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check the manifest (sizes and sha256) and return the parsed config.json."""
    path = Path(path)
    recover_interrupted_swap(path)
    manifest_path = path / MANIFEST_FILE
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}")
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST_FILE})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupt: {e}") from None
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise CheckpointError(
                f"checkpoint file {file} has {file.stat().st_size} bytes, expected "
                f"{expected['bytes']}: it is truncated or was modified"
            )
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint file {file} fails its sha256 check: it is corrupt")
    return json.loads((path / CONFIG_FILE).read_text())


def load_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    with_trainer_state: bool = False,
    **model_overrides: Any,
) -> Checkpoint:
    """Load a verified checkpoint. Nothing in it can execute code: weights are safetensors and
    the trainer state is read with torch.load(weights_only=True).
    model_overrides replace GPTConfig fields (e.g. attention="sdpa", dropout=0.0)."""
    path = Path(path)
    config = verify_checkpoint(path)
    try:
        model_config = GPTConfig.from_dict({**config["model"], **model_overrides})
        model = GPT(model_config)
        state = load_file(str(path / MODEL_FILE), device="cpu")
        if model_config.tie_embeddings:
            state["lm_head.weight"] = state["transformer.wte.weight"]
        model.load_state_dict(state)
    except (SafetensorError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"cannot load the weights in {path}: {e}") from None
    trainer_state = None
    if with_trainer_state:
        file = path / TRAINER_FILE
        if not file.is_file():
            raise CheckpointError(f"{path} has no trainer state ({TRAINER_FILE}) to resume from")
        try:
            trainer_state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means "not loadable"
            raise CheckpointError(f"cannot load {file} safely: {e}") from None
    return Checkpoint(path, model.to(device), config["run"], config["meta"], trainer_state)


def resolve_checkpoint(path: str | Path, prefer: str = "best") -> Path:
    """A checkpoint directory from a checkpoint directory, a run directory (its `prefer`
    checkpoint, else the other), or a `checkpoints/` directory."""
    path = Path(path).expanduser()
    candidates = [path]
    for base in (path / "checkpoints", path):
        order = (prefer, "last" if prefer == "best" else "best")
        candidates += [base / name for name in order]
    for candidate in candidates:
        recover_interrupted_swap(candidate)
        if (candidate / MANIFEST_FILE).is_file():
            return candidate
    raise CheckpointError(
        f"no checkpoint found at {path} (looked for {MANIFEST_FILE} in: "
        + ", ".join(str(c) for c in candidates)
        + ")"
    )


def latest_checkpoint(runs_root: str | Path = "outputs", prefer: str = "best") -> Path:
    """The newest run's checkpoint under `runs_root` (Hydra's default output tree)."""
    root = Path(runs_root).expanduser()
    manifests = sorted(
        root.glob(f"**/checkpoints/*/{MANIFEST_FILE}"), key=lambda p: p.stat().st_mtime
    )
    manifests = [m for m in manifests if not m.parent.name.startswith(".")]
    if not manifests:
        raise CheckpointError(
            f"no checkpoint found under {root.resolve()}: train one with `python train.py`, "
            "or pass checkpoint=<run dir>"
        )
    return resolve_checkpoint(manifests[-1].parent.parent.parent, prefer)
