"""Files and directories written whole or not at all, files checked against their recorded size
and sha256, a safetensors file's header read alone, and a user's UTF-8 text file read with a
one-line error.

Everything written for a later reader (prepared data, checkpoints, exports, the run's records,
the precision cache) goes through `atomic_path`, `write_atomic` or `write_dir_atomic`: written
under a hidden temporary name next to its destination (`.<name>.tmp-<pid>`: one per process, so
concurrent writers such as torchrun ranks never share one), fsynced, then renamed into place
with os.replace, atomic within one file system. A reader, or a run restarted after kill -9 or a
power cut, finds the previous version or the new one, never part of one. The temporary names
are plain files and directories (not mkstemp's 0600 or mkdtemp's 0700), so what is written
follows the umask and teammates can read it where the umask allows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NamedTuple

from safetensors import SafetensorError, safe_open

from base.errors import CheckpointError, DataError

MAX_JSON_BYTES = 16 << 20  # a model's config.json, our manifest.json: a few KB
HASH_CHUNK = 1 << 20  # bytes per read when hashing; 1 MiB measured fastest (0.25-8 MiB tried)
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}  # weights' types: bytes a value


class TensorInfo(NamedTuple):
    dtype: str  # safetensors' name: "F32", "BF16", ...
    shape: tuple[int, ...]


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in `file`, a checkpoint's or a model directory's (config.json, ours or
    Hugging Face's; manifest.json), which may be untrusted: one too large to be a model's is
    refused unread (no reading gigabytes), one that is not a JSON object is corrupt; each a
    one-line CheckpointError."""
    if (size := file.stat().st_size) > MAX_JSON_BYTES:
        raise CheckpointError(f"{file} has {size:,} bytes: too large to be a model's")
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{file} is corrupt: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file} is corrupt: not a JSON object")
    return value


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """name -> (dtype, shape) of every tensor in a safetensors file, from its header alone (the
    byte ranges checked against the file by safetensors: a shape is backed by bytes that exist).
    Raises CheckpointError naming the file if the header is malformed or claims bytes it lacks."""
    try:
        with safe_open(str(path), "pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 - not a dict
            return {k: TensorInfo(s.get_dtype(), tuple(s.get_shape())) for k, s in slices.items()}
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a valid safetensors file: {e}") from None


def writable_error(directory: str | Path) -> str | None:
    """Why `directory` cannot be written (read-only, a path through a regular file, no
    permission), or None when it can: made if missing, then a temporary file created in it."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return "a file is in the way" if isinstance(e, FileExistsError) else str(e.strerror or e)
    return None


def sha256_file(path: str | Path) -> str:
    """The file's sha256, streamed in `HASH_CHUNK` reads (never the whole file in memory)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_files(files: list[tuple[Path, int, str]], record: str, error: type[Exception]) -> None:
    """Check every (file, size, sha256) that the file `record` vouches for (prepared data's
    meta.json, a checkpoint's manifest.json): all sizes first (a truncated file fails without
    reading anything), then every byte in one streaming pass. A mismatch, or a file missing or
    unreadable, raises `error` naming it."""
    try:
        for file, size, _ in files:
            if (actual := file.stat().st_size) != size:
                raise error(
                    f"{file} has {actual:,} bytes but {record} records {size:,} "
                    "(truncated or overwritten)"
                )
        for file, _, expected in files:
            if (actual := sha256_file(file)) != expected:
                raise error(
                    f"{file} fails its sha256 check (it is corrupt: {actual[:12]}..., "
                    f"{record} records {expected[:12]}...)"
                )
    except FileNotFoundError as e:
        raise error(f"{e.filename} is missing") from e
    except OSError as e:
        raise error(f"{e.filename} cannot be read ({e.strerror})") from e


def fsync(path: str | Path) -> None:
    """Flush a file's or a directory's data (for a directory: its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary(path: Path) -> Path:
    """This process's temporary name for `path`'s new content: `.<name>.tmp-<pid>`."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write `path`'s new content to; when the block succeeds it is
    fsynced and renamed to `path`, when it fails it is deleted."""
    path = Path(path)
    tmp = temporary(path)
    try:
        yield tmp
        fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync(path.parent)  # the rename itself survives a power cut


def write_atomic(path: str | Path, content: bytes | str | Callable[[Path], object]) -> None:
    """Replace `path` whole with `content` (text is written as UTF-8), or with what
    `content(tmp)` writes to the temporary path it is given."""
    with atomic_path(path) as tmp:
        if callable(content):
            content(tmp)
        else:
            tmp.write_bytes(content.encode() if isinstance(content, str) else content)


def aside(path: Path) -> Path:
    """Where `write_dir_atomic` moves the previous directory while it swaps the new one in."""
    return path.with_name(f".{path.name}.old")


def recover_swap(path: str | Path) -> None:
    """Put the previous directory back if a crash came between the two renames of a swap
    (moved aside, the new one not yet in). Readers call it before looking at `path`: every
    rank of a restarted torchrun job at once, so another may put it back first."""
    path = Path(path)
    if not path.exists() and aside(path).exists():
        with suppress(FileNotFoundError):  # the aside is gone: put back by the other reader
            os.replace(aside(path), path)


def link_files(source: Path, target: Path) -> None:
    """Hard-link every file of the directory `source` into `target` (a copy where the
    filesystem has no hard links)."""
    for file in source.iterdir():
        try:
            os.link(file, target / file.name)
        except OSError:
            shutil.copy2(file, target / file.name)


def write_dir_atomic(path: str | Path, fill: Callable[[Path], object]) -> None:
    """Replace the directory `path` whole with the files `fill(tmp)` writes into a new empty
    directory (a flat one: files only).

    The files are given the directory's umask-derived mode (safetensors writes 0600), fsynced,
    and swapped in by two renames: the previous `path` aside (`aside`), the new one in; the old
    one is deleted last. At every instant `path` or its aside holds a complete directory, and
    `recover_swap` puts the aside one back after a crash between the renames. A write that
    fails leaves `path` as it was and no temporary directory."""
    path = Path(path)
    old = aside(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_swap(path)  # before anything could delete `old`, maybe the only complete copy
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # any process's, left by a crash
        shutil.rmtree(stale, ignore_errors=True)
    tmp = temporary(path)
    tmp.mkdir()
    try:
        fill(tmp)
        for file in tmp.iterdir():
            file.chmod(tmp.stat().st_mode & 0o666)
            fsync(file)
        fsync(tmp)
        shutil.rmtree(old, ignore_errors=True)  # `path` exists (recovered above): a leftover
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        fsync(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        recover_swap(path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_utf8(
    path: Path, key: str, errors: str = "strict", fix: str = "convert it to UTF-8, e.g. with iconv"
) -> str:
    """The text of the UTF-8 file `path`, given as `key`; a missing file or one that is not
    UTF-8 is a DataError naming both, and `fix` says what to do."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{key} {path.resolve()} does not exist") from None
    except IsADirectoryError:
        raise DataError(f"{key} {path.resolve()} is a directory; give a file") from None
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise DataError(
            f"{key} {path} is not UTF-8 text (byte {e.start} is not valid UTF-8); {fix}"
        ) from None
