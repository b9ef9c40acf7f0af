"""What an offline W&B run wrote, read back from disk for the tests (``WANDB_MODE=offline``): its
``run-<id>.wandb`` file — a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
chunks, each with a CRC-32 over its type and data (checked here), its length and its type (full,
first, middle, last), each record a ``wandb_internal_pb2.Record`` — and its tables, JSON files
under the run's ``files/`` folder, named by the history. (wandb 0.31 ships no Python reader.)"""

from __future__ import annotations

import json
import struct
import zlib

from privmon.report import tags

_HEADER, _BLOCK = 7, 32768
_FULL, _LAST = 1, 4


def read_records(path):
    """Every Record of a ``.wandb`` file, in order (each chunk's CRC checked)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, out = _HEADER, b"", []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if (crc, length, kind) == (0, 0, 0):  # zero padding to the block's end
            pos += left
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc
        pos += _HEADER + length
        pending += chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def read_items(items):
    """{key: value} of history / config items (nested keys joined by '/')."""
    out = {}
    for item in items:
        key = item.key or "/".join(item.nested_key)
        out[key] = json.loads(item.value_json)
    return out


class OfflineRun:
    """What an offline run wrote: its metric definitions, history rows, config and tables."""

    def __init__(self, run_dir):
        (path,) = run_dir.glob("run-*.wandb")
        self.files = run_dir / "files"
        records = read_records(path)
        self.metrics = [r.metric for r in records if r.HasField("metric")]
        self.rows = [read_items(r.history.item) for r in records if r.HasField("history")]
        self.config = {}
        for r in records:
            if r.HasField("config"):
                self.config.update(read_items(r.config.update))

    def checks(self, step_key=tags.WANDB_STEP):
        """The history rows that hold a check, by privmon step."""
        return {row[step_key]: row for row in self.rows if step_key in row}

    def table(self, row, key):
        """The table logged under ``key`` in ``row``: (columns, data)."""
        stored = json.loads((self.files / row[f"{key}/path"]).read_text())
        return stored["columns"], stored["data"]
