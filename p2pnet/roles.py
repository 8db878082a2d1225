"""The roles a peer can take, and where each one's code lives.

A peer with no role only gossips and keeps its peer table. A role is built from the running node and its TOML section, and is run in the node's nursery:

    class Role(Protocol):
        async def run(self, *, task_status) -> None   # started() once serving, then runs forever
        def status(self) -> dict                        # shown by `p2pnet peer status --json`

Roles live in the packages that own them (relay, verify, trainer); this table is the only place
p2pnet names them, imported lazily so a plain peer never loads torch.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import trio

from p2pnet.errors import ConfigError

ROLE_FACTORIES = {
    "relay": "relay.role:RelayRole",
    "worker": "trainer.roles:WorkerRole",
    "validator": "verify.daemon:ValidatorRole",
    "trainer": "trainer.roles:TrainerRole",
}


class Role(Protocol):
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...

    def status(self) -> dict[str, Any]: ...


def build_role(name: str, node: Any, section: dict[str, Any]) -> Role:
    target = ROLE_FACTORIES.get(name)
    if target is None:
        raise ConfigError("peer.roles", f"unknown role {name!r}; known: {sorted(ROLE_FACTORIES)}")
    module_name, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("peer.roles", f"role {name!r} is not available in this install: {exc}") from exc
    return factory(node, section)
