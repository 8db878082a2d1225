"""The transfer core's settings (`TransferConfig`) and the layouts it can plan (`LAYOUTS`).

Read by `relay.transfer.TransferCore` and the mixins it is built from, by the relay role's
configuration (`relay.config`) and by the simulator; `relay.transfer` imports both names back,
so they are importable from there as before. Plain frozen data checked by `p2pnet.config`'s
`validated`; no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pnet.config import validated

LAYOUTS = ("striped", "tree", "star", "swarm")


@validated
@dataclass(frozen=True)
class TransferConfig:
    stripes: int = 16
    window_per_source: int = 2
    max_in_flight: int = 16
    stall_timeout_s: float = 30.0
    exclude_s: float = 60.0
    not_admitted_s: float = 2.0  # by then the source has our heartbeat: the refused fetch sent it (`Node.introduce`)
    announce_interval_s: float = 5.0
    corrupt_penalty: float = 5.0
    manifest_retry_s: float = 5.0
    announce_sample: int = 8  # about this many holders gossip `Holding` per interval, network-wide
    layout: str = "striped"  # "tree", "star" and "swarm" exist as baselines for the simulator
    tree_fanout: int = 4
    stable_plan: bool = True  # see `relay.planner.plan_broadcast`
    swarm_degree: int = 8  # the swarm layout: neighbours we pick (those that pick us come on top)
    have_interval_s: float = 0.2  # the swarm layout: our bitmap goes out at most this often

    def check(self) -> dict[str, str]:
        problems = {}
        if self.layout not in LAYOUTS:
            problems["layout"] = f"must be one of {LAYOUTS}"
        if self.tree_fanout < 1:
            problems["tree_fanout"] = "must be >= 1"
        for name in ("stripes", "window_per_source", "max_in_flight", "announce_sample", "swarm_degree"):
            if getattr(self, name) < 1:
                problems[name] = "must be >= 1"
        for name in ("stall_timeout_s", "exclude_s", "not_admitted_s", "announce_interval_s", "manifest_retry_s", "have_interval_s"):
            if not getattr(self, name) > 0:
                problems[name] = "must be > 0"
        if self.corrupt_penalty < 0:
            problems["corrupt_penalty"] = "must be >= 0"
        return problems

