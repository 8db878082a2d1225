"""Structured logs: `--log-format json` writes one JSON object per record on stderr.

Every record, libp2p's and hypercorn's included (they reach the root handler, see
`p2pnet.host.adopt_libp2p_logging`), carries the same fields:

    time     ISO 8601 UTC with milliseconds ("2026-12-01T03:04:05.678Z")
    level    DEBUG, INFO, WARNING, ERROR or CRITICAL
    peer_id  this process's peer id, once the peer has loaded its key ("" before)
    role     the role whose code logged it (relay, validator, worker, trainer), else "peer"
    event    a stable name for what happened: the `event` given in `extra=`, else the record's
             message template with its placeholders removed ("rejected %s from %s" ->
             "rejected_from"), so a query can group records whatever values they carry
    logger   the logger's name; message: the formatted text; exc: the traceback, when any

This module owns the formatter and the per-process context (`set_log_context`, called by the
node once its identity is known). It must not configure handlers or levels (`p2pnet.cli` does)
nor log anything itself.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

LOG_FORMATS = ("text", "json")

_context: dict[str, Any] = {"peer_id": "", "roles": ()}
_PLACEHOLDER = re.compile(r"%(\([^)]*\))?[-#0 +]*\d*(\.\d+)?[a-zA-Z%]")
_NON_WORD = re.compile(r"[^a-z0-9]+")
# logger name prefix -> the role whose code it is; the trainer package serves two roles
_ROLE_OF_LOGGER = (("relay", "relay"), ("verify", "validator"), ("trainer.roles", None), ("trainer", "trainer"))


def set_log_context(peer_id: str, roles: tuple[str, ...] | list[str]) -> None:
    """Stamp every later record of this process with `peer_id`; `roles` tell the trainer
    package's records apart (a worker peer's are `worker`, a trainer peer's `trainer`)."""
    _context["peer_id"] = peer_id
    _context["roles"] = tuple(roles)


def role_of(logger_name: str) -> str:
    for prefix, role in _ROLE_OF_LOGGER:
        if logger_name == prefix or logger_name.startswith(prefix + "."):
            if role is not None:
                return role
            roles = _context["roles"]
            return "trainer" if "trainer" in roles else "worker" if "worker" in roles else "trainer"
    return "peer"


def event_name(template: Any) -> str:
    """`rejected %s from %s` -> `rejected_from`: the template's words, at most eight."""
    text = _PLACEHOLDER.sub(" ", str(template)).lower()
    words = [w for w in _NON_WORD.split(text) if w and not w.isdigit()]
    return "_".join(words[:8]) or "log"


class JsonFormatter(logging.Formatter):
    """One line of JSON per record, with the fields the module docstring lists."""

    def format(self, record: logging.LogRecord) -> str:
        created = time.gmtime(record.created)
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", created) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "peer_id": _context["peer_id"],
            "role": getattr(record, "role", None) or role_of(record.name),
            "event": getattr(record, "event", None) or event_name(record.msg),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, default=str, ensure_ascii=False)
