"""Read the records of an offline wandb run file (`run-*.wandb`), to check what was logged.

The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks, each with a
7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and a protobuf Record.
"""

from __future__ import annotations

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = struct.Struct("<IHB")


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a wandb run file"
    pos, records, pending = 7, [], b""
    while pos + HEADER.size <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER.size:
            pos += left_in_block  # block padding
            continue
        _, length, kind = HEADER.unpack_from(data, pos)
        if length == 0 and kind == 0:
            break  # zero padding at the end of the file
        chunk = data[pos + HEADER.size : pos + HEADER.size + length]
        pos += HEADER.size + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def logged(path: Path) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(config {key: json value}, history rows [{key: json value}]) of one run file."""
    config, history = {}, []
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update({item.key: item.value_json for item in record.config.update})
        elif kind == "run":
            config.update({item.key: item.value_json for item in record.run.config.update})
        elif kind == "history":
            history.append(
                {
                    item.key or "/".join(item.nested_key): item.value_json
                    for item in record.history.item
                }
            )
    return config, history
