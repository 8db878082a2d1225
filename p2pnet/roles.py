"""The roles a peer can take, and where each one's code lives.

A peer with no role only gossips and keeps its peer table. A role is built from the running node and its TOML section, and is run in the node's nursery:

    class Role(Protocol):
        async def run(self, *, task_status) -> None   # started() once serving, then runs forever
        def status(self) -> dict                        # shown by `p2pnet peer status --json`

A role that drives a protocol core runs it in a nursery the role owns, `runner = await
nursery.start(node.run_core, core, name)`: the core stops with the role.

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
    "diloco": "trainer.diloco_role:DilocoRole",
}


# each role's typed config, checked for every [section] in the file whether or not its role runs
ROLE_CONFIGS = {
    "relay": "relay.config:RelayConfig",
    "worker": "trainer.roles:WorkerConfig",
    "validator": "verify.daemon:ValidatorConfig",
    "trainer": "trainer.roles:TrainerConfig",
    "diloco": "trainer.diloco_role:DilocoConfig",
}
PEER_SECTIONS = ("peer", "peertable")  # checked by the command that starts the peer


def check_sections(sections: dict[str, Any]) -> None:
    """Refuse unknown TOML sections (a typo'd `[peeer]`) and check each role's section that is
    present, so a bad value fails at start even when that role is not enabled."""
    from p2pnet.config import from_mapping

    known = [*PEER_SECTIONS, *ROLE_FACTORIES]
    for name, table in sections.items():
        if name not in known:
            raise ConfigError(name, f"unknown section [{name}]; known: {', '.join(f'[{k}]' for k in known)}")
        if name in ROLE_CONFIGS:
            module_name, _, attr = ROLE_CONFIGS[name].partition(":")
            try:
                config_class = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise ConfigError(name, f"role {name!r} is not available in this install: {exc}") from exc
            from_mapping(config_class, table, name)



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
