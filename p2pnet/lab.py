"""The network lab: real hosts on one machine, each a Linux network namespace.

This module owns building and removing such a network (namespaces, veth pairs, bridges,
bandwidth limits, NAT routers) and running processes inside its hosts. It must not know what
runs there (peers are started by their callers through `Lab.wrap`), and it must never touch the
root namespace's links, routes or firewall: the root namespace only names the namespaces.

Layout, for lab id X (all names are ours: the `p2pl-` prefix is what `cleanup_stale` may remove):

    p2pl-X_sw           the "internet": a bridge br0; no addresses
    p2pl-X-<host>       a public host: eth0 = 10.213.a.b/16, its other end h-<host> on br0
    p2pl-X_nat-<group>  a NAT router: wan = a public address on br0, a bridge lan = 10.214.g.1/24,
                        ip_forward on, nftables masquerade out of wan, no new connections in
    p2pl-X-<host>       a NAT'd host: eth0 = 10.214.g.j/24 on that lan, default route via .1

Public endpoints (hosts and router WANs, in spec order) get 10.213.<i // 200>.<i % 200 + 10>.
Public hosts have no route to 10.214.0.0/16, so dialling a private address fails at once with
"network unreachable"; a NAT'd host's connections arrive from its router's public address.

Bandwidth: the upload limit is a tbf qdisc on the egress of the host's eth0, the download limit
one on the egress of the other end of that veth (on the switch or the router's lan). tbf counts
whole frames, so TCP goodput is about 95.6% of the configured rate (1448 payload bytes per
1514-byte frame). Measured here, one TCP flow, burst max(32 KiB, rate/250 bytes) and latency
50 ms: 200 mbit gave 23.9 MB/s of 25.0 (95.7%), 40 mbit 4.78 of 5.0, 1000 mbit 120.8 of 125.
Latency and loss cannot be emulated: netem is not in this kernel.

The pure part (`HostSpec`, `LabSpec`, `plan`, `setup_commands`, `teardown_commands`,
`addresses`) needs no privileges; `Lab` runs the commands and needs root, `ip`, `tc`, and
`nft` (Debian package nftables) when any host is behind NAT.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from p2pnet.errors import ConfigError, LocalStateError
from p2pnet.files import atomic_write_bytes

PREFIX = "p2pl-"
LAB_FILE = "lab.json"
REGISTRY_DIR = Path("/run/p2pnet-lab")  # one record per live lab; tmpfs, like /run/netns
COMMAND_TIMEOUT_S = 30.0
MAX_PUBLIC_ENDPOINTS = 1000  # a Linux bridge takes at most 1024 ports
MAX_NAT_GROUPS = 250
MAX_HOSTS_PER_NAT = 200
_NAME = re.compile(r"[a-z0-9-]{1,12}")
_LAB_ID = re.compile(r"[a-z0-9]{1,16}")


class LabError(LocalStateError):
    """Building, using or removing the lab on this machine failed; the message says which step."""


class LabUnavailable(LabError):
    """This machine cannot run the lab (not root, a tool missing); the message is one line."""


@dataclass(frozen=True)
class HostSpec:
    """One host: a name ([a-z0-9-]{1,12}), optional limits in Mbit/s, optional NAT group name.

    Hosts that name the same `nat` group sit behind one router (one public address).
    """

    name: str
    upload_mbit: float | None = None
    download_mbit: float | None = None
    nat: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError("host.name", f"must match [a-z0-9-]{{1,12}} (got {self.name!r})")
        for field in ("upload_mbit", "download_mbit"):
            value = getattr(self, field)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.001 <= value <= 100_000:
                raise ConfigError(f"host {self.name}.{field}", f"must be a number in [0.001, 100000] (got {value!r})")
            object.__setattr__(self, field, float(value))
        if self.nat is not None and (not isinstance(self.nat, str) or not _NAME.fullmatch(self.nat)):
            raise ConfigError(f"host {self.name}.nat", f"a group name must match [a-z0-9-]{{1,12}} (got {self.nat!r})")


@dataclass(frozen=True)
class LabSpec:
    """A whole lab: its hosts (unique names) and an id ([a-z0-9]{1,16}) unique on this machine."""

    hosts: tuple[HostSpec, ...]
    lab_id: str
    mtu: int = 1500  # of every link; 9000 cuts the kernel's per-packet work when many hosts share few cores

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", tuple(self.hosts))
        if not isinstance(self.mtu, int) or not 576 <= self.mtu <= 9000:
            raise ConfigError("lab.mtu", f"must be an integer in [576, 9000] (got {self.mtu!r})")
        if not isinstance(self.lab_id, str) or not _LAB_ID.fullmatch(self.lab_id):
            raise ConfigError("lab.id", f"must match [a-z0-9]{{1,16}} (got {self.lab_id!r})")
        if not self.hosts:
            raise ConfigError("lab.hosts", "a lab needs at least one host")
        names = [h.name for h in self.hosts]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError("lab.hosts", f"host names must be unique (repeated: {', '.join(duplicates)})")
        groups = self.nat_groups
        if len(groups) > MAX_NAT_GROUPS:
            raise ConfigError("lab.hosts", f"at most {MAX_NAT_GROUPS} NAT groups (got {len(groups)})")
        public = sum(1 for h in self.hosts if h.nat is None) + len(groups)
        if public > MAX_PUBLIC_ENDPOINTS:
            raise ConfigError("lab.hosts", f"at most {MAX_PUBLIC_ENDPOINTS} public hosts and routers (got {public})")
        for group in groups:
            members = sum(1 for h in self.hosts if h.nat == group)
            if members > MAX_HOSTS_PER_NAT:
                raise ConfigError("lab.hosts", f"NAT group {group}: at most {MAX_HOSTS_PER_NAT} hosts (got {members})")

    @property
    def nat_groups(self) -> tuple[str, ...]:
        """NAT group names in order of first appearance."""
        return tuple(dict.fromkeys(h.nat for h in self.hosts if h.nat is not None))


@dataclass(frozen=True)
class LabHost:
    """A host as built: `ip` is its own address, `public_ip` the one others see it connect from."""

    name: str
    netns: str
    ip: str
    public_ip: str
    nat: str | None
    upload_mbit: float | None
    download_mbit: float | None
    link_netns: str  # the namespace holding the other end of its veth (switch or router)
    link_dev: str  # that other end's name (h-<name>)


@dataclass(frozen=True)
class LabRouter:
    """A NAT group's router: `public_ip` on the switch, `lan_ip` the hosts' default gateway."""

    group: str
    netns: str
    public_ip: str
    lan_ip: str


@dataclass(frozen=True)
class LabPlan:
    """Every name and address of a lab, computed from its spec alone."""

    switch_netns: str
    hosts: tuple[LabHost, ...]
    routers: tuple[LabRouter, ...]

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Hosts first, then routers, then the switch: the order they are removed in."""
        return (*(h.netns for h in self.hosts), *(r.netns for r in self.routers), self.switch_netns)


def _public_ip(index: int) -> str:
    return f"10.213.{index // 200}.{index % 200 + 10}"


def plan(spec: LabSpec) -> LabPlan:
    """Names and addresses for `spec` (pure, deterministic)."""
    base = f"{PREFIX}{spec.lab_id}"
    switch = f"{base}_sw"
    routers: dict[str, LabRouter] = {}
    lan_count: dict[str, int] = {}
    hosts: list[LabHost] = []
    public_index = 0
    for h in spec.hosts:
        if h.nat is None:
            ip = _public_ip(public_index)
            public_index += 1
            hosts.append(LabHost(h.name, f"{base}-{h.name}", ip, ip, None, h.upload_mbit, h.download_mbit,
                                 switch, f"h-{h.name}"))
            continue
        if h.nat not in routers:
            lan_count[h.nat] = 0
            routers[h.nat] = LabRouter(h.nat, f"{base}_nat-{h.nat}", _public_ip(public_index),
                                       f"10.214.{len(routers)}.1")
            public_index += 1
        router = routers[h.nat]
        ip = f"{router.lan_ip.rsplit('.', 1)[0]}.{lan_count[h.nat] + 10}"
        lan_count[h.nat] += 1
        hosts.append(LabHost(h.name, f"{base}-{h.name}", ip, router.public_ip, h.nat, h.upload_mbit,
                             h.download_mbit, router.netns, f"h-{h.name}"))
    return LabPlan(switch, tuple(hosts), tuple(routers.values()))


def addresses(spec: LabSpec) -> dict[str, str]:
    """Host name -> its own IP address (a private 10.214.x.y one for NAT'd hosts)."""
    return {h.name: h.ip for h in plan(spec).hosts}


def tbf_args(rate_mbit: float) -> list[str]:
    """The tbf qdisc arguments for a limit: burst max(32 KiB, 4 ms of traffic), latency 50 ms."""
    rate_bit = round(rate_mbit * 1_000_000)
    burst_bytes = max(32 * 1024, rate_bit // 8 // 250)
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst_bytes), "latency", "50ms"]


def _nat_rules(netns: str) -> list[list[str]]:
    nft = ["ip", "netns", "exec", netns, "nft"]
    return [
        [*nft, "add", "table", "ip", "p2pl"],
        [*nft, "add", "chain", "ip", "p2pl", "postrouting",
         "{ type nat hook postrouting priority srcnat; policy accept; }"],
        [*nft, "add", "rule", "ip", "p2pl", "postrouting", "oifname", "wan", "masquerade"],
        [*nft, "add", "chain", "ip", "p2pl", "forward",
         "{ type filter hook forward priority filter; policy accept; }"],
        [*nft, "add", "rule", "ip", "p2pl", "forward", "iifname", "wan", "ct", "state", "!=",
         "{ established, related }", "drop"],
    ]


def setup_commands(spec: LabSpec) -> list[list[str]]:
    """The argv lists that build `spec`, in order. Each names the namespace it acts in."""
    p = plan(spec)
    cmds: list[list[str]] = []
    for ns in (p.switch_netns, *(r.netns for r in p.routers), *(h.netns for h in p.hosts)):
        cmds += [["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"]]
    sw = p.switch_netns
    cmds += [["ip", "-n", sw, "link", "add", "br0", "type", "bridge"], ["ip", "-n", sw, "link", "set", "br0", "up"]]
    for r in p.routers:
        wire = f"r-{r.group}"
        cmds += [
            ["ip", "link", "add", "wan", "mtu", str(spec.mtu), "netns", r.netns, "type", "veth", "peer", "name", wire,
             "mtu", str(spec.mtu), "netns", sw],
            ["ip", "-n", sw, "link", "set", wire, "master", "br0"],
            ["ip", "-n", sw, "link", "set", wire, "up"],
            ["ip", "-n", r.netns, "addr", "add", f"{r.public_ip}/16", "dev", "wan"],
            ["ip", "-n", r.netns, "link", "set", "wan", "up"],
            ["ip", "-n", r.netns, "link", "add", "lan", "type", "bridge"],
            ["ip", "-n", r.netns, "addr", "add", f"{r.lan_ip}/24", "dev", "lan"],
            ["ip", "-n", r.netns, "link", "set", "lan", "up"],
            ["ip", "netns", "exec", r.netns, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
            *_nat_rules(r.netns),
        ]
    gateways = {r.group: r.lan_ip for r in p.routers}
    for h in p.hosts:
        bridge = "br0" if h.nat is None else "lan"
        prefix = 16 if h.nat is None else 24
        cmds += [
            ["ip", "link", "add", "eth0", "mtu", str(spec.mtu), "netns", h.netns, "type", "veth", "peer",
             "name", h.link_dev, "mtu", str(spec.mtu), "netns", h.link_netns],
            ["ip", "-n", h.link_netns, "link", "set", h.link_dev, "master", bridge],
            ["ip", "-n", h.link_netns, "link", "set", h.link_dev, "up"],
            ["ip", "-n", h.netns, "addr", "add", f"{h.ip}/{prefix}", "dev", "eth0"],
            ["ip", "-n", h.netns, "link", "set", "eth0", "up"],
        ]
        if h.nat is not None:
            cmds.append(["ip", "-n", h.netns, "route", "add", "default", "via", gateways[h.nat]])
        if h.upload_mbit is not None:
            cmds.append(["tc", "-n", h.netns, "qdisc", "add", "dev", "eth0", "root", *tbf_args(h.upload_mbit)])
        if h.download_mbit is not None:
            cmds.append(["tc", "-n", h.link_netns, "qdisc", "add", "dev", h.link_dev, "root",
                         *tbf_args(h.download_mbit)])
    return cmds


def teardown_commands(spec: LabSpec) -> list[list[str]]:
    """The argv lists that remove `spec`'s namespaces (their links go with them)."""
    return [["ip", "netns", "del", ns] for ns in plan(spec).namespaces]


# --- running commands and probing this machine ---------------------------------------------


def _run(argv: Sequence[str], *, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    """Run one lab command; its stdout, or `LabError` naming the command and its stderr."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"lab: `{' '.join(argv)}` failed: {exc}") from exc
    if done.returncode != 0:
        err = done.stderr.strip().replace("\n", "; ") or "(no output)"
        raise LabError(f"lab: `{' '.join(argv)}` failed (exit {done.returncode}): {err}")
    return done.stdout


def existing_netns() -> set[str]:
    """Names of the network namespaces that exist now (`ip netns list`)."""
    return {line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()}


def netns_pids(netns: str) -> list[int]:
    """Pids of the processes inside `netns`; empty when it is gone."""
    try:
        out = _run(["ip", "netns", "pids", netns])
    except LabError:
        return []
    return [int(tok) for tok in out.split() if tok.isdigit() and int(tok) != os.getpid()]


def _probe(steps: Iterable[tuple[str, list[str]]], netns: str) -> str | None:
    try:
        for what, argv in steps:
            try:
                _run(argv)
            except LabError as exc:
                return f"lab: cannot {what} here ({str(exc).partition(': ')[2][:200]})"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False, timeout=COMMAND_TIMEOUT_S)


@functools.cache
def lab_unavailable() -> str | None:
    """None when the lab can run here, else one line saying why (tried once, then cached)."""
    if os.geteuid() != 0:
        return f"lab: needs root to create network namespaces (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"lab: needs `{tool}` (Debian package iproute2)"
    probe = f"p2plprobe{os.getpid()}"  # not our lab prefix: cleanup_stale never races with it
    return _probe([
        ("create a network namespace", ["ip", "netns", "add", probe]),
        ("create a veth pair", ["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"]),
        ("add a tbf qdisc", ["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", *tbf_args(100)]),
    ], probe)


@functools.cache
def nat_unavailable() -> str | None:
    """Like `lab_unavailable`, for labs with NAT'd hosts (they also need nftables)."""
    reason = lab_unavailable()
    if reason is not None:
        return reason
    if shutil.which("nft") is None:
        return "lab: NAT needs `nft` (apt-get install nftables, or p2pnet.lab.ensure_nft())"
    probe = f"p2plprobe{os.getpid()}"
    return _probe([
        ("create a network namespace", ["ip", "netns", "add", probe]),
        *(("load nftables NAT rules", argv) for argv in _nat_rules(probe)[:3]),
    ], probe)


def ensure_nft() -> bool:
    """Install nftables with apt-get when running as root and `nft` is missing; True if present."""
    if shutil.which("nft") is None and os.geteuid() == 0 and shutil.which("apt-get") is not None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        try:
            for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "nftables"]):
                if subprocess.run(argv, capture_output=True, env=env, timeout=600, check=False).returncode != 0:
                    break
        except (OSError, subprocess.TimeoutExpired):
            pass  # reported by the return value (and by nat_unavailable's line)
        nat_unavailable.cache_clear()
    return shutil.which("nft") is not None


def _terminate(pids: Iterable[int], grace_s: float) -> None:
    """SIGTERM `pids`, wait up to `grace_s` for them to exit, SIGKILL the rest (pidfds: no reuse race)."""
    fds: list[int] = []
    for pid in set(pids):
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            continue
    try:
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for fd in fds:
                try:
                    signal.pidfd_send_signal(fd, sig)
                except ProcessLookupError:
                    pass
            fds = _wait_exits(fds, wait_s)
            if not fds:
                return
    finally:
        for fd in fds:
            os.close(fd)


def _wait_exits(fds: list[int], timeout_s: float) -> list[int]:
    """Wait until the pidfds' processes exit or `timeout_s` passes; close and drop the exited ones."""
    deadline = time.monotonic() + timeout_s
    alive = list(fds)
    poller = select.poll()
    for fd in alive:
        poller.register(fd, select.POLLIN)
    while alive:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            break
        for fd, _ in poller.poll(left_ms):
            poller.unregister(fd)
            alive.remove(fd)
            os.close(fd)
    return alive


def _lab_id_of(netns: str) -> str | None:
    if not netns.startswith(PREFIX):
        return None
    rest = netns[len(PREFIX):]
    ident = re.match(r"[a-z0-9]+", rest)
    return ident.group(0) if ident and rest[ident.end():ident.end() + 1] in ("-", "_") else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists; it just is not ours to signal
    return True


# --- the lab itself -------------------------------------------------------------------------


class Lab:
    """A built lab: `hosts` by name; `wrap(name)` runs a process inside one; `down()` removes it.

    Build one with `Lab.up` (or re-open it with `Lab.load`); use it as a context manager to be
    sure it is removed. Its record (`lab.json` in its state directory, a copy in REGISTRY_DIR)
    names the owner pid: `cleanup_stale` removes labs whose owner died without `down()`. A
    persistent lab (owner None, as the CLI makes) stays until `p2pnet lab down`.
    """

    def __init__(self, spec: LabSpec, state_dir: Path, owner_pid: int | None) -> None:
        self.spec = spec
        self.state_dir = Path(state_dir)
        self.owner_pid = owner_pid
        self.plan = plan(spec)
        self.hosts: dict[str, LabHost] = {h.name: h for h in self.plan.hosts}
        self.routers: dict[str, LabRouter] = {r.group: r for r in self.plan.routers}
        self._children: list[subprocess.Popen[Any]] = []

    @property
    def lab_id(self) -> str:
        return self.spec.lab_id

    @property
    def namespaces(self) -> tuple[str, ...]:
        return self.plan.namespaces

    @classmethod
    def up(cls, spec: LabSpec, state_dir: Path, *, persistent: bool = False) -> Lab:
        """Build `spec`; on any failure remove what was made and raise `LabError`."""
        reason = nat_unavailable() if spec.nat_groups else lab_unavailable()
        if reason is not None:
            raise LabUnavailable(reason)
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        if (state_dir / LAB_FILE).exists():
            old = cls.load(state_dir)
            if set(old.namespaces) & existing_netns():
                raise LabError(f"lab: {state_dir} already holds lab {old.lab_id}; take it down first "
                               f"(p2pnet lab down --dir {state_dir})")
        lab = cls(spec, state_dir, None if persistent else os.getpid())
        clash = sorted(ns for ns in existing_netns() if _lab_id_of(ns) == spec.lab_id)
        if clash:
            raise LabError(f"lab: id {spec.lab_id} is in use on this machine ({clash[0]} exists)")
        lab._claim()
        try:
            for argv in setup_commands(spec):
                _run(argv)
            atomic_write_bytes(state_dir / LAB_FILE, lab._record())
        except BaseException as exc:
            try:
                lab.down()
            except LabError as cleanup:
                exc.add_note(f"and removing the half-built lab failed: {cleanup}")
            raise
        return lab

    @classmethod
    def load(cls, state_dir: Path) -> Lab:
        """Re-open the lab recorded in `state_dir/lab.json`."""
        path = Path(state_dir) / LAB_FILE
        try:
            record = json.loads(path.read_bytes())
            hosts = tuple(HostSpec(h["name"], h["upload_mbit"], h["download_mbit"], h["nat"])
                          for h in record["hosts"])
            return cls(LabSpec(hosts, record["lab_id"], record.get("mtu", 1500)), Path(state_dir), record["owner_pid"])
        except FileNotFoundError as exc:
            raise LabError(f"lab: no lab in {state_dir} (no {LAB_FILE}); start one with p2pnet lab up") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise LabError(f"lab: {path} is unreadable ({exc}); remove it and any p2pl-* namespaces by hand") from exc

    def host(self, name: str) -> LabHost:
        try:
            return self.hosts[name]
        except KeyError:
            raise ConfigError("host", f"no host {name!r} in lab {self.lab_id} (hosts: {', '.join(self.hosts)})") from None

    def wrap(self, name: str) -> list[str]:
        """The argv prefix that runs a command inside host `name`."""
        return ["ip", "netns", "exec", self.host(name).netns]

    def run(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """`subprocess.run(argv, **kwargs)` inside host `name`."""
        return subprocess.run([*self.wrap(name), *argv], **kwargs)

    def popen(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """`subprocess.Popen(argv, **kwargs)` inside host `name`; `down()` stops and reaps it.

        `ip netns exec` execs the command, so the Popen's pid is the command's own.
        """
        proc = subprocess.Popen([*self.wrap(name), *argv], **kwargs)
        self._children.append(proc)
        return proc

    def status(self) -> dict[str, Any]:
        """The lab's record plus, per host, whether its namespace exists and how many processes it holds."""
        existing = existing_netns()
        record = json.loads(self._record())
        for h in record["hosts"]:
            h["up"] = h["netns"] in existing
            h["processes"] = len(netns_pids(h["netns"])) if h["up"] else 0
        record["up"] = all(ns in existing for ns in self.namespaces)
        return record

    def down(self, *, grace_s: float = 3.0) -> None:
        """Stop every process inside the lab, delete its namespaces and its record. Idempotent."""
        existing = existing_netns()
        ours = [ns for ns in self.namespaces if ns in existing]
        _terminate((pid for ns in ours for pid in netns_pids(ns)), grace_s)
        for proc in self._children:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=5)
        self._children.clear()
        failed = []
        for argv in teardown_commands(self.spec):
            if argv[-1] in ours:
                try:
                    _run(argv)
                except LabError as exc:
                    failed.append(str(exc))
        self._forget()
        if failed:
            raise LabError(f"lab {self.lab_id}: could not remove everything: {failed[0]}")

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    def _record(self) -> bytes:
        record = {
            "format": 1,
            "lab_id": self.lab_id,
            "mtu": self.spec.mtu,
            "owner_pid": self.owner_pid,
            "state_dir": str(self.state_dir.resolve()),
            "namespaces": list(self.namespaces),
            "hosts": [dataclasses.asdict(h) for h in self.plan.hosts],
            "routers": [dataclasses.asdict(r) for r in self.plan.routers],
        }
        return json.dumps(record, indent=2).encode() + b"\n"

    def _claim(self) -> None:
        """Write the registry record before making anything, so nothing of ours is ever unowned.

        Written whole under a temporary name, then hard-linked into place: the link fails if the
        id is taken, and no reader ever sees a half-written record.
        """
        REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
        tmp = REGISTRY_DIR / f".{self.lab_id}.{os.getpid()}.tmp"
        tmp.write_bytes(self._record())
        try:
            os.link(tmp, REGISTRY_DIR / f"{self.lab_id}.json")
        except FileExistsError as exc:
            raise LabError(f"lab: id {self.lab_id} is in use on this machine "
                           f"({REGISTRY_DIR}/{self.lab_id}.json exists)") from exc
        finally:
            tmp.unlink()

    def _forget(self) -> None:
        (REGISTRY_DIR / f"{self.lab_id}.json").unlink(missing_ok=True)
        path = self.state_dir / LAB_FILE
        try:
            if json.loads(path.read_bytes()).get("lab_id") == self.lab_id:
                path.unlink()
        except (FileNotFoundError, ValueError):
            pass


def cleanup_stale(*, grace_s: float = 3.0) -> list[str]:
    """Remove the `p2pl-*` namespaces whose lab's owner process is dead; the names removed.

    A namespace with our prefix and no registry record is stale too (records are written before
    anything is made and removed last). Persistent labs (owner None) are left alone. Does
    nothing where the lab cannot run (not root).
    """
    if lab_unavailable() is not None:
        return []
    by_lab: dict[str, list[str]] = {}
    for ns in existing_netns():
        lab_id = _lab_id_of(ns)
        if lab_id is not None:
            by_lab.setdefault(lab_id, []).append(ns)
    records = {p.stem: p for p in REGISTRY_DIR.glob("*.json")} if REGISTRY_DIR.is_dir() else {}
    removed: list[str] = []
    for lab_id in sorted(set(by_lab) | set(records)):
        record: dict[str, Any] = {}
        if lab_id in records:
            try:
                record = json.loads(records[lab_id].read_bytes())
            except (OSError, ValueError):
                record = {}
        owner = record.get("owner_pid", 0)  # no readable record: nobody owns these
        if owner is None or (isinstance(owner, int) and owner > 0 and _pid_alive(owner)):
            continue  # persistent, or its owner still runs
        names = sorted(by_lab.get(lab_id, []), key=lambda ns: ns.endswith("_sw"))  # switch last
        _terminate((pid for ns in names for pid in netns_pids(ns)), grace_s)
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False, timeout=COMMAND_TIMEOUT_S)
        left = existing_netns()
        removed += [ns for ns in names if ns not in left]
        if record.get("state_dir"):
            stale = Path(record["state_dir"]) / LAB_FILE
            try:
                if json.loads(stale.read_bytes()).get("lab_id") == lab_id:
                    stale.unlink()
            except (OSError, ValueError):
                pass
        records.get(lab_id, REGISTRY_DIR / f"{lab_id}.json").unlink(missing_ok=True)
    return removed
