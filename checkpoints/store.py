"""Checkpoints: safe to load, atomic to write, verified on read; and the model sources that
`checkpoint=` and `train.init_from=` accept (the end of this file).

Layout of one checkpoint directory (`<run_dir>/checkpoints/last/` or `.../best/`):

    model.safetensors   the weights (tensors only: loading them cannot run code)
    config.json         {"model": GPTConfig fields, "run": the resolved run config, "meta": {...}}
    trainer.pt          optimizer, step, RNG and data position; loaded with weights_only=True
    tokenizer.json      a trained tokenizer (data.tokenizer=bpe-<N>), so that the checkpoint
                        alone can sample and evaluate; absent for built-in tokenizers
    manifest.json       size and sha256 of each file above; written last

A sharded checkpoint (parallel.checkpoint=sharded) holds the weights, and the optimizer's
moments, in shard-<rank>-of-<ranks>.safetensors files with shards.json in place of
model.safetensors (checkpoints/sharded.py); every reader below reads either.

A checkpoint is written into a temporary sibling directory and swapped into place
(base.files.write_dir_atomic), so a crash at any instant leaves either the previous complete
checkpoint or the new one, never a mixture; every reader first recovers a swap a crash cut short.
Directories without a valid manifest (an interrupted write) are never picked up.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tiktoken
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from base.errors import CheckpointError, ConfigError
from base.files import (
    FLOAT_DTYPES,
    TensorInfo,
    read_json_object,
    read_safetensors_header,
    recover_swap,
    sha256_file,
    verify_files,
    writable_error,
    write_dir_atomic,
)
from data.chat import TEMPLATE, chat_tokenizer
from data.tokenizer import TOKENIZER_FILE, load_tokenizer, parse_tokenizer, tokenizer_fingerprint
from model import GPT, GPTConfig

if TYPE_CHECKING:  # types only: reading a checkpoint loads neither the data pipeline nor, for a
    from checkpoints.sharded import Shards  # whole one, sharded.py
    from data.pipeline import PreparedData

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TRAINER_FILE = "trainer.pt"
MANIFEST_FILE = "manifest.json"
SHARDS_FILE = "shards.json"  # a sharded checkpoint's, in model.safetensors' place


# ----- what a weights file says ------------------------------------------------------------------

# What a weights file says, checked before anything is allocated for it.
#
# `read_safetensors_header` (base/files.py) reads a safetensors file's header alone (no tensor
# data) through safetensors itself, which refuses a header whose byte ranges do not tile the rest
# of the file exactly: the shapes it returns are backed by bytes that really exist, so whoever
# loads the tensors allocates no more than the file's size. `check_config_against_weights`
# compares a claimed GPTConfig with those shapes, naming the key and both values, on a model built
# on the meta device (no memory), before the real model is built.


def check_config_against_weights(
    config: GPTConfig, tensors: dict[str, TensorInfo], source: str = "the weights"
) -> None:
    """Raise CheckpointError naming the config key and both values if `config` does not describe
    the tensors (as read_safetensors_header returns them, in our checkpoints' layout)."""
    wte = tensors.get("transformer.wte.weight")
    if wte is None or len(wte.shape) != 2:
        raise CheckpointError(f"{source} have no token embedding transformer.wte.weight (2-D)")
    layers = {int(m[1]) for k in tensors if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    wpe = tensors.get("transformer.wpe.weight")
    claims = [
        ("vocab_size", config.vocab_size, wte.shape[0], "transformer.wte.weight"),
        ("n_embd", config.n_embd, wte.shape[1], "transformer.wte.weight"),
        ("n_layer", config.n_layer, max(layers, default=-1) + 1, "transformer.h.<i>"),
        ("tie_embeddings", config.tie_embeddings, "lm_head.weight" not in tensors, "lm_head"),
        ("pos_embedding", config.pos_embedding, "rope" if wpe is None else "learned", "wpe"),
    ]
    if wpe is not None and len(wpe.shape) == 2:
        claims.append(("block_size", config.block_size, wpe.shape[0], "transformer.wpe.weight"))
    for key, claimed, actual, tensor in claims:
        if claimed != actual:
            raise CheckpointError(
                f"model.{key}={claimed!r} disagrees with {source}, which give "
                f"{key}={actual!r} (from {tensor})"
            )
    expected = GPT.stored_shapes(config)
    for name in sorted(expected.keys() | tensors.keys()):
        keys = next(k for part, k in _KEYS if part in name)
        if name not in tensors:
            raise CheckpointError(f"the config's model has {name}, {source} do not (see {keys})")
        if name not in expected:
            raise CheckpointError(f"{source} hold {name}, the config's model does not (see {keys})")
        if (shape := tensors[name].shape) != expected[name]:
            raise CheckpointError(
                f"{source} give {name} the shape {shape}, the config's model {expected[name]} "
                f"(see {keys})"
            )
        if (dtype := tensors[name].dtype) not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{source} store {name} as {dtype}; weights are one of {list(FLOAT_DTYPES)}"
            )


_KEYS = (  # (part of a tensor's name, the config keys that decide its existence and shape)
    ("norm.weight", "model.qk_norm and model.n_head"),
    (".mlp.", "model.mlp, model.mlp_ratio and model.bias"),
    (".bias", "model.bias and model.norm"),
    ("", "model.norm"),
)


# ----- our checkpoints ---------------------------------------------------------------------------


def tokenizer_name(run_config: dict[str, Any], meta: dict[str, Any]) -> str:
    """The data.tokenizer a checkpoint's model was trained with, from its config.json."""
    return meta.get("tokenizer") or (run_config.get("data") or {}).get("tokenizer") or "gpt2"


@dataclass
class Checkpoint:
    path: Path
    model: GPT
    run_config: dict[str, Any]
    meta: dict[str, Any]
    trainer_state: dict[str, Any] | None = None

    @property
    def tokenizer_name(self) -> str:
        """The data.tokenizer the model was trained with."""
        return tokenizer_name(self.run_config, self.meta)

    @property
    def chat_template(self) -> str | None:
        """The chat template a chat fine-tuned model was trained with (data/chat.py)."""
        return self.meta.get("chat_template")

    def tokenizer(self) -> tiktoken.Encoding:
        """The tokenizer the model was trained with, from the checkpoint alone (a trained one
        from its verified copy of tokenizer.json). A model with fewer rows than the tokenizer
        has ids (a Hugging Face export of a bytes or bpe model, read as GPT-2) is refused."""
        tokenizer = load_tokenizer(self.tokenizer_name, self.path)
        if self.chat_template:
            tokenizer = chat_tokenizer(tokenizer)
        if self.model.config.vocab_size < tokenizer.n_vocab:
            raise CheckpointError(
                f"{self.path} has a vocabulary of {self.model.config.vocab_size} tokens, fewer "
                f"than its tokenizer {self.tokenizer_name}'s {tokenizer.n_vocab}: a Hugging Face "
                "dir must hold a GPT-2-tokenized model; use the checkpoint it was exported from"
            )
        return tokenizer

    def same_tokenizer(self, data: PreparedData) -> bool:
        """Whether `data` is tokenized exactly as this model's training data was (a trained
        tokenizer changes with its training text, not only with its name)."""
        ours = tokenizer_fingerprint(self.tokenizer_name, self.path)
        return ours == tokenizer_fingerprint(data.tokenizer_name, data.dir)


def check_writable(directory: str | Path) -> None:
    """Fail at the start of a run, not at its first checkpoint, if `directory` cannot be
    written."""
    if (reason := writable_error(directory)) is not None:
        raise CheckpointError(f"cannot write checkpoints to {directory}: {reason}")


@contextlib.contextmanager
def _os_errors() -> Iterator[None]:
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
            raise OSError(code, os.strerror(code)) from e
        raise


def save_checkpoint(
    path: str | Path,
    model: GPT,
    run_config: dict[str, Any],
    meta: dict[str, Any],
    trainer_state: dict[str, Any] | None = None,
    tokenizer_file: str | Path | None = None,
    write_shards: Callable[[Path], dict[str, Any]] | None = None,
) -> Path:
    """Write a complete checkpoint at `path`, replacing any previous one atomically;
    `tokenizer_file` (a trained tokenizer's file) is copied in as tokenizer.json.
    `write_shards(tmp)`, for a sharded checkpoint (checkpoints/sharded.py), writes the weights
    instead of model.safetensors, with every rank, and returns the manifest entries of the
    files it wrote (each rank hashes its own).

    A write that fails (a read-only directory, a full disk) raises CheckpointError naming the
    path and the cause; the previous checkpoint at `path` is left as it was, and the partial
    new one is removed."""
    path = Path(path)

    def fill(tmp: Path) -> None:
        hashed = {}  # files their ranks hashed
        with _os_errors():
            if write_shards is not None:
                hashed = write_shards(tmp)
            else:
                state = {k: v.cpu().contiguous() for k, v in model.stored_state().items()}
                save_file(state, str(tmp / MODEL_FILE))
        config = {"model": model.config.to_dict(), "run": run_config, "meta": meta}
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        if trainer_state is not None:
            with _os_errors(), open(tmp / TRAINER_FILE, "wb") as f:
                torch.save(trainer_state, f)
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / TOKENIZER_FILE)
        files = sorted(tmp.iterdir())
        manifest = {f.name: hashed.get(f.name) or manifest_entry(f) for f in files}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))

    try:
        write_dir_atomic(path, fill)
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint to {path}: {e.strerror or e}; {_previous(path)}"
        ) from e
    return path


def manifest_entry(file: Path) -> dict[str, Any]:
    return {"bytes": file.stat().st_size, "sha256": sha256_file(file)}


def _previous(path: Path) -> str:
    """What a failed write left at `path`, for the error message."""
    try:
        recover_swap(path)
        step = json.loads((path / CONFIG_FILE).read_text())["meta"].get("step")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "there is no previous checkpoint there"
    at = "" if step is None else f" (step {step})"
    return f"the previous checkpoint at {path}{at} is intact"


def is_complete(path: Path) -> bool:
    """Whether `path` holds a checkpoint whose write finished (it has its manifest)."""
    recover_swap(path)
    return (path / MANIFEST_FILE).is_file()


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint against its manifest and return its parsed, checked config.json.

    Every name the manifest lists must be a plain file name (all are checked before any file is
    opened) and lead to a file inside `path`; every file the loader reads must be listed; every
    listed file's size and sha256 must match."""
    path = Path(path)
    manifest_file, manifest = _json_object(path, MANIFEST_FILE)
    for name, entry in manifest.items():
        if name in ("", ".", "..") or set(name) & set("/\\\0"):
            raise CheckpointError(
                f"{manifest_file} lists {name!r}, which is not a plain file name inside the "
                "checkpoint (no separators, '..' or absolute paths): refusing to open it"
            )
        sized = isinstance(entry, dict) and type(entry.get("bytes")) is int
        if not (sized and re.fullmatch(r"[0-9a-f]{64}", str(entry.get("sha256")))):
            raise CheckpointError(
                f"{manifest_file} is corrupt: the entry for {name!r} is not "
                '{"bytes": <size>, "sha256": <64 hex digits>}'
            )
    weights = SHARDS_FILE if SHARDS_FILE in manifest else MODEL_FILE  # sharded: sharded.py
    shards = [f.name for f in path.glob("shard-*")]
    for name in (MODEL_FILE, CONFIG_FILE, TRAINER_FILE, TOKENIZER_FILE, SHARDS_FILE, *shards):
        required = name in (weights, CONFIG_FILE)  # the others only when present
        if name not in manifest and (required or os.path.lexists(path / name)):
            raise CheckpointError(
                f"checkpoint file {path / name} is not listed in {manifest_file}: "
                "nothing unverified is read"
            )
    files = [(_inside(path, name), e["bytes"], e["sha256"]) for name, e in manifest.items()]
    verify_files(files, str(manifest_file), CheckpointError)
    return read_config(path)


def read_config(path: str | Path) -> dict[str, Any]:
    """A complete checkpoint's config.json, {"model": {...}, "run": {...}, "meta": {...}}, with
    the values the loader reads from "run" and "meta" of the right type (the "model" fields:
    GPTConfig checks them). Read without hashing the weights: for what a run needs to know
    before it loads (a resume's config, `best`'s loss); `load_checkpoint` verifies every file."""
    file, config = _json_object(Path(path), CONFIG_FILE)
    if unknown := sorted(set(config) - {"model", "run", "meta"}):
        raise CheckpointError(f"{file}: unknown key(s) {unknown}; known: model, run, meta")
    for key in ("model", "run", "meta"):
        if not isinstance(config.get(key), dict):
            raise CheckpointError(f"{file}: {key} must be a JSON object, got {config.get(key)!r}")
    if not isinstance(data := config["run"].get("data"), (dict, type(None))):
        raise CheckpointError(f"{file}: run.data must be a JSON object, got {data!r}")
    for where, values in (("meta", config["meta"]), ("run.data", data or {})):
        if not isinstance(tokenizer := values.get("tokenizer"), (str, type(None))):
            raise CheckpointError(f"{file}: {where}.tokenizer must be a string, got {tokenizer!r}")
    if (template := config["meta"].get("chat_template")) not in (None, TEMPLATE):
        raise CheckpointError(f"{file}: meta.chat_template must be {TEMPLATE!r}, got {template!r}")
    return config


def _json_object(path: Path, name: str) -> tuple[Path, dict[str, Any]]:
    """(the file, its JSON object) of a complete checkpoint's `name`; anything else is a
    CheckpointError naming the file."""
    if not is_complete(path):
        raise CheckpointError(f"no complete checkpoint at {path} (no {MANIFEST_FILE})")
    file = _inside(path, name)
    return file, read_json_object(file)


def _inside(path: Path, name: str) -> Path:
    """path / name, refused if it is a symlink leading out of `path` (checked without opening
    it: a name resolves through links, not through the file)."""
    file = path / name
    if file.resolve().parent != path.resolve():
        raise CheckpointError(
            f"checkpoint file {file} is a symlink leading out of {path}: refusing to read it"
        )
    return file


def load_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    with_trainer_state: bool = False,
    **model_overrides: Any,
) -> Checkpoint:
    """Load a verified checkpoint. Nothing in it can execute code: weights are safetensors and
    the trainer state is read with torch.load(weights_only=True). Nothing it claims is believed
    before it is checked: the config's fields like command-line values, and the config against
    the shapes in the weights' header (no tensor read, no model allocated) before the model is
    built, so that the weights then load as they are.
    model_overrides replace GPTConfig fields (e.g. attention="sdpa", dropout=0.0)."""
    path = Path(path)
    config = verify_checkpoint(path)
    shards, tensors = _shards(path) if (path / SHARDS_FILE).exists() else (None, {})
    try:
        tensors = read_safetensors_header(path / MODEL_FILE) if shards is None else tensors
    except ValueError as e:
        raise CheckpointError(f"cannot load the weights in {path}: {e}") from None
    try:
        model_config = GPTConfig.from_dict({**config["model"], **model_overrides})
        check_config_against_weights(model_config, tensors, f"the weights in {MODEL_FILE}")
    except ValueError as e:
        raise CheckpointError(f"{path / CONFIG_FILE}: {e}") from None
    model = GPT(model_config)
    state = load_file(str(path / MODEL_FILE)) if shards is None else _whole(shards, tensors)
    if model_config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state)
    trainer_state = None
    if with_trainer_state:
        file = path / TRAINER_FILE
        if not file.exists():  # verified: present if and only if the manifest lists it
            raise CheckpointError(f"{path} has no trainer state ({TRAINER_FILE}) to resume from")
        try:
            trainer_state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means "not loadable"
            raise CheckpointError(f"cannot load {file} safely: {e}") from None
        try:  # its moments as ShardedTensors: a resume reads the rows it holds
            trainer_state = trainer_state if shards is None else shards.tree(trainer_state)
        except ValueError as e:
            raise CheckpointError(f"{file} {e}") from None
    return Checkpoint(path, model.to(device), config["run"], config["meta"], trainer_state)


def _shards(path: Path) -> tuple[Shards, dict[str, TensorInfo]]:
    """A sharded checkpoint's tensors (checkpoints/sharded.py), its index checked against the
    headers of the shards the manifest verified, and its weights as a header would give them."""
    from checkpoints.sharded import Shards

    file, index = _json_object(path, SHARDS_FILE)
    try:
        shards = Shards(path, index, listed=set(_json_object(path, MANIFEST_FILE)[1]))
    except (ValueError, SafetensorError) as e:
        raise CheckpointError(f"{file} is corrupt: {e}") from None
    weights = [n for n in shards.shapes if n.startswith("model/")]
    return shards, {n[6:]: TensorInfo(shards.dtypes[n], shards.shapes[n]) for n in weights}


def _whole(shards: Shards, tensors: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """A sharded checkpoint's weights read whole into this process, from each rank's rows; the
    memory it takes said first (by rank 0 alone under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        size = sum(math.prod(t.shape) * FLOAT_DTYPES[t.dtype] for t in tensors.values())
        print(
            f"{shards.directory}: reading its {shards.world_size}-way sharded weights whole into "
            f"this process: {size / 2**20:,.1f} MiB",
            file=sys.stderr,
        )
    return {name: shards.rows(f"model/{name}", 0, t.shape[0]) for name, t in tensors.items()}


def resolve_checkpoint(path: str | Path, prefer: str = "best") -> Path:
    """A checkpoint directory from a checkpoint directory, a run directory (its `prefer`
    checkpoint, else the other), or a `checkpoints/` directory."""
    path = Path(path).expanduser()
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file; a checkpoint is a directory (its {MANIFEST_FILE} beside the "
            f"weights): pass {path.parent}"
        )
    order = (prefer, "last" if prefer == "best" else "best")
    candidates = [path, *(base / name for base in (path / "checkpoints", path) for name in order)]
    for candidate in candidates:
        if is_complete(candidate):
            return candidate
    looked = ", ".join(map(str, candidates))
    raise CheckpointError(
        f"no checkpoint found at {path} (looked for {MANIFEST_FILE} in: {looked})"
    )


def find_checkpoint() -> Path:
    """What a null `checkpoint=` of sample.py, evaluate.py, serve.py and export.py means: the
    newest run's checkpoint in ./outputs (Hydra's default output tree)."""
    manifests = Path("outputs").glob(f"**/checkpoints/[!.]*/{MANIFEST_FILE}")  # not temporaries
    newest = max(manifests, key=lambda p: p.stat().st_mtime, default=None)
    if newest is None:
        raise CheckpointError(
            f"no checkpoint found under {Path('outputs').resolve()}: train one with "
            "`python train.py`, or pass checkpoint=<run dir>"
        )
    return resolve_checkpoint(newest.parents[2])


STEP_PREFIX = "step-"  # step checkpoints: checkpoints/step-<step>/ (train.keep_checkpoints)


def prune_step_checkpoints(ckpt_dir: str | Path, keep: int, newest: str) -> list[Path]:
    """Delete all but the `keep` most recently written complete step checkpoints in `ckpt_dir`
    (`newest`, the one just written, is always kept); returns what was deleted.

    Only complete checkpoints (`step-<n>/` with a manifest) count and are deleted: temporary
    and swap directories (`.step-<n>.tmp-*`, `.step-<n>.old`) belong to a write in progress or
    to its recovery. Each is renamed aside before it is deleted, so a crash mid-delete leaves
    no `step-<n>/` with some files missing, only a hidden leftover removed by the next prune."""
    ckpt_dir = Path(ckpt_dir)
    for leftover in ckpt_dir.glob(f".{STEP_PREFIX}*.pruning"):
        shutil.rmtree(leftover, ignore_errors=True)
    steps = {  # number -> manifest of each complete step checkpoint
        int(number): m
        for m in ckpt_dir.glob(f"{STEP_PREFIX}*/{MANIFEST_FILE}")
        if (number := m.parent.name.removeprefix(STEP_PREFIX)).isdecimal()
    }
    # Oldest write first (a resumed run may rewrite lower steps after higher ones).
    by_age = sorted(
        steps, key=lambda n: (f"{STEP_PREFIX}{n}" == newest, steps[n].stat().st_mtime_ns, n)
    )
    deleted = [steps[n].parent for n in by_age[: max(len(steps) - keep, 0)]]
    for path in deleted:
        aside = path.with_name(f".{path.name}.pruning")
        os.replace(path, aside)
        shutil.rmtree(aside)
    return deleted


def checkpoint_bytes(path: str | Path) -> int:
    """The size on disk of a checkpoint's files."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def resume_source(resume: str | None, run_dir: str | Path) -> Path | None:
    """The checkpoint `train.resume` names: `auto` is `run_dir`'s `last` checkpoint, or None
    when the run has none yet (then it starts from scratch); a path is resolved as above."""
    if resume is None:
        return None
    if resume == "auto":
        last = Path(run_dir) / "checkpoints" / "last"
        return last if is_complete(last) else None
    return resolve_checkpoint(resume, prefer="last")


# ----- model sources: what checkpoint= and train.init_from= accept -------------------------------

# The one resolver behind train.init_from, sample.py, evaluate.py and export.py, so that every
# place accepting a model accepts the same three kinds of source:
# 1. a GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl): fetched through the Hugging Face hub
#    client, which downloads it once and then serves it from its cache (HF_HUB_OFFLINE=1: the
#    cache alone);
# 2. a local directory holding a Hugging Face GPT-2 model (config.json + model.safetensors or
#    pytorch_model.bin, the latter read with weights_only=True: no code runs);
# 3. one of our checkpoint or run directories.
# Each loads as a `Checkpoint`. A Hugging Face model has no run config of ours; its stand-in has
# one data section, `HF_DATA` (the Shakespeare plays, GPT-2's tokenizer), which is what
# `evaluate.py checkpoint=gpt2` scores. Its weights go through checkpoints/hf.py, imported for
# such a source alone.

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
ACCEPTED = (
    f"a GPT-2 name ({', '.join(GPT2_NAMES)}), a Hugging Face GPT-2 directory (config.json + "
    "model.safetensors or pytorch_model.bin), or a causalgpt run or checkpoint directory"
)
HF_DATA = {"name": "shakespeare", "tokenizer": "gpt2"}  # what evaluate.py scores GPT-2 on


def is_hf_dir(path: Path) -> bool:
    """A Hugging Face model directory: config.json and weights, and no manifest.json (ours carry
    one; theirs do not)."""
    weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    return (path / "config.json").is_file() and not (path / MANIFEST_FILE).is_file() and weights


def load_source(
    source: str | Path, device: str | torch.device = "cpu", **overrides: Any
) -> Checkpoint:
    """Load any model source (see the comment above) on `device`; overrides: run-time
    GPTConfig fields (dropout, attention)."""
    name, path = str(source), Path(source).expanduser()
    hub = name in GPT2_NAMES and not Path(name).exists()
    if hub or is_hf_dir(path):
        ckpt = load_hf_dir(download_gpt2(name) if hub else path, device, **overrides)
        if hub:  # the name, not the hub cache's directory
            ckpt.meta["source"] = name
        return ckpt
    return load_checkpoint(_source_checkpoint(path), device, **overrides)


def download_gpt2(name: str) -> Path:
    """The local directory of GPT-2 `name` in the hub client's cache, downloaded if missing
    (config.json and model.safetensors only: every GPT-2 repository has safetensors)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=["config.json", "model.safetensors"]))
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"{name} is not in the Hugging Face cache and the hub cannot be reached (offline, or "
            f"HF_HUB_OFFLINE=1); download it once with network access, or point at a local copy: "
            f"a directory with config.json and model.safetensors, e.g. "
            f"train.init_from=/path/to/{name} (or checkpoint=/path/to/{name})"
        ) from None
    except OSError as e:  # the hub's HTTP errors derive from OSError too
        raise ConfigError(f"could not download {name} from the Hugging Face hub: {e}") from None


def load_hf_dir(path: Path, device: str | torch.device = "cpu", **overrides: Any) -> Checkpoint:
    """A Hugging Face GPT-2 directory as a Checkpoint (GPT-2's tokenizer, no trainer state)."""
    from checkpoints.hf import load_hf_gpt2  # for such a source alone

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path / 'config.json'}: {e}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != "gpt2":
        raise CheckpointError(
            f"{path} holds a {model_type!r} model; Hugging Face directories must hold GPT-2 "
            "(model_type 'gpt2' in config.json)"
        )
    try:
        model = load_hf_gpt2(path, **overrides)
    except (KeyError, RuntimeError) as e:  # missing tensors; unreadable weights
        raise CheckpointError(f"cannot load the GPT-2 weights in {path}: {e}") from None
    meta = {"tokenizer": "gpt2", "source": str(path), "step": None}
    return Checkpoint(path, model.to(device), {"data": dict(HF_DATA)}, meta)


def _source_checkpoint(path: Path) -> Path:
    try:
        return resolve_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; a model source is {ACCEPTED}") from None


def source_tokenizer(source: str | Path) -> dict[str, str | None]:
    """The data keys that tokenize text as `source`'s own training text was, read from its
    config alone (nothing loaded): data.tokenizer, and for a trained one (bpe-<N>)
    data.tokenizer_dir, the checkpoint holding its tokenizer.json. A Hugging Face model is
    GPT-2's. What a run with train.init_from and evaluate.py's data=/dataset= tokenize with."""
    path = Path(source).expanduser()
    if (str(source) in GPT2_NAMES and not path.exists()) or is_hf_dir(path):
        return {"tokenizer": "gpt2", "tokenizer_dir": None}
    path = _source_checkpoint(path)
    config = read_config(path)
    name = tokenizer_name(config["run"], config["meta"])
    trained = parse_tokenizer(name) is not None
    return {"tokenizer": name, "tokenizer_dir": str(path.absolute()) if trained else None}


# ----- train.init_from: a source's model for a new run -------------------------------------------

# The source fixes the architecture; a run may change only what does not change the weights'
# meaning: dropout, the attention implementation, and a shorter context (block_size, the position
# table cropped). Optimizer, schedule and step start fresh: that is what sets it apart from
# train.resume, which continues a run.

RUNTIME_KEYS = ("dropout", "attention", "flash_block_q", "flash_block_k")


def pretrained_model(source: str, requested: dict[str, Any], data: PreparedData) -> GPT:
    """The model of `source` with this run's run-time fields. `requested`: the model keys the
    run sets (see trainer/config.py); any other one that differs from the source's is an error
    naming it, as is a tokenizer other than the one the source was trained with."""
    runtime = {k: requested[k] for k in RUNTIME_KEYS if k in requested}
    ckpt = load_source(source, **runtime)
    theirs = ckpt.model.config
    if not ckpt.same_tokenizer(data):
        name = ckpt.tokenizer_name
        hint = f", which was trained with {name}: drop data.tokenizer (the source's is the default)"
        if data.tokenizer_name == name:
            hint = " (the same name, trained on other text): drop data.tokenizer_dir"
        raise ConfigError(
            f"data.tokenizer={data.tokenizer_name} does not match the vocabulary of "
            f"train.init_from={source}{hint}"
        )
    values = {k: v for k, v in requested.items() if not (k == "vocab_size" and v is None)}
    block_size = values.pop("block_size", theirs.block_size)
    GPTConfig.from_dict({**theirs.to_dict(), **values})  # unknown keys, bad values: named
    for key, value in values.items():
        if key not in RUNTIME_KEYS and value != getattr(theirs, key):
            raise ConfigError(
                f"model.{key}={value!r} contradicts train.init_from={source}, whose {key} is "
                f"{getattr(theirs, key)!r}: the architecture comes from the source; drop "
                f"model.{key} (run-time keys it allows: {', '.join(RUNTIME_KEYS)}, block_size)"
            )
    if block_size != theirs.block_size:
        ckpt.model.crop_block_size(block_size)
    add_template_tokens(ckpt, data)
    return ckpt.model


def add_template_tokens(ckpt: Checkpoint, data: PreparedData) -> None:
    """A base model read for conversations (chat fine-tuning it, or scoring it on them before):
    the chat template's two tokens get rows, the mean of the tokenizer's rows (GPT.add_tokens)."""
    if data.chat_template and not ckpt.chat_template:
        base = data.vocab_size - 2  # the template's two tokens follow the tokenizer's ids
        ckpt.model.add_tokens(range(base, data.vocab_size), mean_of=base)
