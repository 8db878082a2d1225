"""The trainer's per-step metrics file, `metrics.jsonl` in its data directory.

One JSON object per line, one line per training step, appended and flushed as each step ends
(`time` is the wall clock, seconds since the epoch), so the file outlives the process: a
restarted trainer appends after what is there. A line cut short by a crash is skipped by
`read_metrics`, and the next append starts on a fresh line so it cannot be glued to it.

This module owns the file's format and nothing else: the trainer role says what goes in a row.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def tokens_of(batches: Iterable[Any]) -> int:
    """Output tokens of admitted batches (each rollout's output ids are 4 bytes per token)."""
    return sum(len(r.output_ids) // 4 for b in batches for r in b.submission.rollouts)


class MetricsFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._torn = self._ends_mid_line(path)

    @staticmethod
    def _ends_mid_line(path: Path) -> bool:
        try:
            with open(path, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                return fh.read(1) != b"\n"
        except FileNotFoundError:
            return False
        except OSError:  # empty file: nothing to seek back over
            return False

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, separators=(",", ":"), sort_keys=True) + "\n"
        if self._torn:
            line = "\n" + line
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
        self._torn = False


TAIL_BLOCK = 1 << 20  # bytes read at a time from the end for `read_metrics(last=...)`


def _last_lines(path: Path, last: int) -> list[str]:
    """The file's last `last` lines, read from its end: what is read is about what is kept."""
    with open(path, "rb") as fh:
        start = fh.seek(0, os.SEEK_END)
        blocks: list[bytes] = []
        newlines = 0
        while start > 0 and newlines <= last:
            size = min(TAIL_BLOCK, start)
            start -= size
            fh.seek(start)
            blocks.append(fh.read(size))
            newlines += blocks[-1].count(b"\n")
    lines = b"".join(reversed(blocks)).decode("utf-8", errors="replace").splitlines()
    return lines[-last:] if start == 0 else lines[1:][-last:]  # (a line begun before `start` is not whole)


def read_metrics(path: Path, last: int | None = None) -> list[dict[str, Any]]:
    """The rows of a metrics file (the `last` lines when given, read from the file's end);
    unreadable lines are skipped."""
    try:
        lines = _last_lines(path, last) if last else path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            log.info("%s: skipped a line that is not JSON (cut short by a crash?)", path)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
