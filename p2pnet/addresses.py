"""Which addresses a peer advertises: concrete, dialable from other hosts, never a wildcard.

A peer listens on a multiaddr (`/ip4/0.0.0.0/tcp/4001`) and a data-plane `host:port`. What it
tells other peers (in heartbeats, `peer status`, the `listening on` lines) must be addresses
they can dial:

- an explicit `announce` list (`--announce`, `[peer] announce`) wins: a host behind port
  forwarding or with a public IP says exactly where it is reached;
- otherwise a wildcard listen address (0.0.0.0 or ::) becomes one address per interface
  address of that family, leaving out loopback (another host dialling 127.0.0.1 reaches
  itself) and IPv6 link-local (unusable without a scope), unless loopback is all there is
  (a peer on a machine with no network is a one-host network, where loopback is right);
- a concrete listen address is advertised as it is.

The data plane follows the same rules for its single `host:port` (`--data-announce`).
Everything here is pure except `interface_ips`, which asks the operating system.
"""

from __future__ import annotations

import ipaddress
import socket

from p2pnet.errors import ConfigError

def interface_ips() -> list[str]:
    """Every IP address assigned to an interface of this host (the only I/O in this module)."""
    import psutil

    out = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6):
                out.append(addr.address.split("%", 1)[0])
    return out


def usable_ips(ips: list[str], family: int) -> list[str]:
    """The addresses of `family` (4 or 6) other hosts can dial: no loopback unless it is all
    there is, never link-local IPv6. Order kept, duplicates dropped."""
    chosen: list[str] = []
    loopback: list[str] = []
    for text in ips:
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            continue
        if ip.version != family or (ip.version == 6 and ip.is_link_local) or ip.is_unspecified:
            continue
        bucket = loopback if ip.is_loopback else chosen
        if text not in bucket:
            bucket.append(text)
    return chosen or loopback


def is_wildcard(host: str) -> bool:
    """Whether `host` is an unspecified address however spelled (`0.0.0.0`, `::`, `0::0`,
    `[::]`, `::ffff:0.0.0.0`): one nobody can dial."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


def _split_ip_multiaddr(addr: str) -> tuple[str, str, str] | None:
    """('ip4'|'ip6', ip, rest) for `/ip4/IP/...`; None for other multiaddrs (dns, p2p-circuit)."""
    parts = addr.split("/")
    if len(parts) >= 3 and parts[0] == "" and parts[1] in ("ip4", "ip6"):
        return parts[1], parts[2], "/" + "/".join(parts[3:]) if len(parts) > 3 else ""
    return None


def with_peer_id(addr: str, peer_id: str) -> str:
    """`addr` ending in `/p2p/<peer_id>` (added when missing; a different id is a user error)."""
    if "/p2p/" in addr:
        if not addr.endswith("/p2p/" + peer_id):
            raise ConfigError("peer.announce", f"{addr!r} names another peer id (this peer is {peer_id})")
        return addr
    return addr.rstrip("/") + "/p2p/" + peer_id


def advertised_addrs(bound: list[str], announce: tuple[str, ...], ips: list[str], peer_id: str) -> list[str]:
    """The full multiaddrs (with /p2p/) this peer tells others, from the addresses it is bound
    to (ports resolved), the operator's `announce` list and this host's interface addresses."""
    if announce:
        return [with_peer_id(a, peer_id) for a in announce]
    out: list[str] = []
    for addr in bound:
        addr = addr.split("/p2p/", 1)[0]
        split = _split_ip_multiaddr(addr)
        if split is None or not is_wildcard(split[1]):
            candidates = [addr]
        else:
            proto, _, rest = split
            candidates = [f"/{proto}/{ip}{rest}" for ip in usable_ips(ips, 4 if proto == "ip4" else 6)]
        for candidate in candidates:
            full = with_peer_id(candidate, peer_id)
            if full not in out:
                out.append(full)
    return out


def parse_host_port(text: str, field: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` into (host, port); a malformed value is the user's error."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
        raise ConfigError(field, f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_data_addr(bound_host: str, bound_port: int, announce: str, ips: list[str]) -> str:
    """The one `host:port` of our data plane that other peers dial."""
    if announce:
        return announce
    if not is_wildcard(bound_host):
        return join_host_port(bound_host, bound_port)
    family = 6 if bound_host == "::" else 4
    usable = usable_ips(ips, family) or usable_ips(ips, 10 - family)
    return join_host_port(usable[0] if usable else "127.0.0.1", bound_port)


def listen_host(listen: str) -> str:
    """The IP a libp2p listen multiaddr binds (the data plane binds the same by default)."""
    split = _split_ip_multiaddr(listen)
    return split[1] if split is not None else "127.0.0.1"


def same_ip(a: str, b: str) -> bool:
    """Equal IPs, with IPv4-mapped IPv6 (::ffff:1.2.3.4) equal to its IPv4 address."""
    try:
        ia, ib = ipaddress.ip_address(a.strip("[]")), ipaddress.ip_address(b.strip("[]"))
    except ValueError:
        return False
    ia = ia.ipv4_mapped or ia if isinstance(ia, ipaddress.IPv6Address) else ia
    ib = ib.ipv4_mapped or ib if isinstance(ib, ipaddress.IPv6Address) else ib
    return ia == ib
