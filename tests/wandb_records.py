"""Read back what wandb wrote to an offline run's ``run-<id>.wandb`` file (tests only).

wandb 0.31 ships no reader for its transaction log. The format is LevelDB's log format
(https://github.com/google/leveldb/blob/main/doc/log_format.md): a 7-byte header
(":W&B", magic 0xBEE1, version), then 32 KiB blocks of records, each with a 7-byte
header (CRC32C, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) and a fragment of one
serialised ``wandb_internal_pb2.Record``. CRCs are not checked: a test reads what a run
it just finished wrote.

``run.finish()`` returns before wandb's service has flushed the file: right after it the file
may hold only its 7-byte header (seen about once in eight runs). A finished run's log ends with
its ``exit`` record, so the reader waits for that record.
"""
from __future__ import annotations

import struct
import time
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path, wait_s: float = 30.0) -> list:
    """Every record of a finished run, once its ``exit`` record is on disk (at most ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        out = _read(path)
        if (out and out[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


def _read(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb transaction log")
    pos, parts, out = HEADER, [], []
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:
            pos += room  # zero padding up to the next block
            continue
        parts.append(data[pos + HEADER:pos + HEADER + length])
        pos += HEADER + length
        if kind in (1, 4):  # FULL or LAST: one complete record
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            out.append(rec)
            parts = []
    return out


def history(path: Path) -> list[dict]:
    """Each logged row as {dotted key: JSON text of the value}."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({".".join(item.nested_key) or item.key: item.value_json for item in rec.history.item})
    return rows


def metric_definitions(path: Path) -> list:
    return [rec.metric for rec in records(path) if rec.WhichOneof("record_type") == "metric"]
