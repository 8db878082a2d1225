"""The network lab: the pure layout (no privileges), then real labs (skipped unless root).

Real tests only contact addresses inside the namespaces they make, stop every process they start
(the lab's `down()` kills what runs inside it, and the tests reap their own children), and check
that no namespace of theirs is left behind.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from p2pnet import lab as labmod
from p2pnet.cli import main
from p2pnet.errors import ConfigError
from p2pnet.lab import (
    HostSpec,
    Lab,
    LabSpec,
    addresses,
    cleanup_stale,
    existing_netns,
    lab_unavailable,
    plan,
    setup_commands,
    tbf_args,
    teardown_commands,
)
from p2pnet.labcli import hosts_from_counts, load_profile

SPEC = LabSpec((HostSpec("a", upload_mbit=40, download_mbit=80), HostSpec("b"),
                HostSpec("n", upload_mbit=10, download_mbit=20, nat="home")), "x1")


# --- pure: layout and commands --------------------------------------------------------------


def test_setup_makes_one_namespace_per_host_plus_switch_and_router():
    made = [c[3] for c in setup_commands(SPEC) if c[:3] == ["ip", "netns", "add"]]
    assert sorted(made) == ["p2pl-x1-a", "p2pl-x1-b", "p2pl-x1-n", "p2pl-x1_nat-home", "p2pl-x1_sw"]
    assert sorted(c[-1] for c in teardown_commands(SPEC)) == sorted(made)
    assert teardown_commands(SPEC)[-1] == ["ip", "netns", "del", "p2pl-x1_sw"]  # hosts and routers first
    for ns in made:
        assert ["ip", "-n", ns, "link", "set", "lo", "up"] in setup_commands(SPEC)


def test_addresses_public_private_and_seen_as():
    assert addresses(SPEC) == {"a": "10.213.0.10", "b": "10.213.0.11", "n": "10.214.0.10"}
    p = plan(SPEC)
    (router,) = p.routers
    assert (router.public_ip, router.lan_ip) == ("10.213.0.12", "10.214.0.1")
    assert {h.name: h.public_ip for h in p.hosts} == {"a": "10.213.0.10", "b": "10.213.0.11", "n": "10.213.0.12"}
    cmds = setup_commands(SPEC)
    assert ["ip", "-n", "p2pl-x1-n", "route", "add", "default", "via", "10.214.0.1"] in cmds
    assert not [c for c in cmds if "route" in c and c[2] != "p2pl-x1-n"]  # public hosts: no route to NAT LANs
    many = LabSpec(tuple(HostSpec(f"h{i}") for i in range(450)), "big")
    ips = addresses(many)
    assert len(set(ips.values())) == 450 and ips["h449"] == "10.213.2.59"


def test_tbf_on_both_ends_with_the_right_rates():
    tc = [c for c in setup_commands(SPEC) if c[0] == "tc"]
    assert all(c[3:6] == ["qdisc", "add", "dev"] and c[7] == "root" for c in tc)
    assert {(c[2], c[6]): c[8:] for c in tc} == {
        ("p2pl-x1-a", "eth0"): tbf_args(40),  # upload: egress of the host's own end
        ("p2pl-x1_sw", "h-a"): tbf_args(80),  # download: egress of the switch's end
        ("p2pl-x1-n", "eth0"): tbf_args(10),
        ("p2pl-x1_nat-home", "h-n"): tbf_args(20),  # a NAT'd host's download: the router's LAN end
    }
    assert tbf_args(40) == ["tbf", "rate", "40000000bit", "burst", "32768", "latency", "50ms"]
    assert tbf_args(1000)[4] == str(1_000_000_000 // 8 // 250)


def test_router_forwards_and_masquerades_out_of_wan_only():
    router = [c[4:] for c in setup_commands(SPEC) if c[:4] == ["ip", "netns", "exec", "p2pl-x1_nat-home"]]
    assert ["sysctl", "-qw", "net.ipv4.ip_forward=1"] in router
    assert ["nft", "add", "rule", "ip", "p2pl", "postrouting", "oifname", "wan", "masquerade"] in router
    assert any("type nat hook postrouting" in arg for c in router for arg in c)
    assert not [c for c in setup_commands(SPEC) if "nft" in c and c[3] != "p2pl-x1_nat-home"]


def test_no_command_touches_the_root_namespace():
    ours = {c[3] for c in setup_commands(SPEC) if c[:3] == ["ip", "netns", "add"]}
    for c in setup_commands(SPEC):
        if c[:3] == ["ip", "netns", "add"]:
            continue
        if c[:2] in (["ip", "-n"], ["tc", "-n"]) or c[:3] == ["ip", "netns", "exec"]:
            assert c[2 if c[1] == "-n" else 3] in ours, c
            continue
        # a veth pair created straight into two of our namespaces: neither end exists in the root one
        assert c[:3] == ["ip", "link", "add"] and c[4:7] == ["mtu", "1500", "netns"], c
        assert c[8:12] == ["type", "veth", "peer", "name"] and c[13:16] == ["mtu", "1500", "netns"], c
        assert c[7] in ours and c[16] in ours and len(c) == 17, c
        assert len(c[3]) <= 15 and len(c[12]) <= 15


@pytest.mark.parametrize("make", [
    lambda: HostSpec("Bad"),
    lambda: HostSpec("a" * 13),
    lambda: HostSpec("a_b"),
    lambda: HostSpec("a", upload_mbit=0),
    lambda: HostSpec("a", download_mbit=-5),
    lambda: HostSpec("a", upload_mbit=True),
    lambda: HostSpec("a", nat="No NAT"),
    lambda: LabSpec((HostSpec("a"), HostSpec("a")), "x"),
    lambda: LabSpec((), "x"),
    lambda: LabSpec((HostSpec("a"),), "x-1"),
    lambda: LabSpec((HostSpec("a"),), ""),
    lambda: LabSpec(tuple(HostSpec(f"h{i}", nat="g") for i in range(201)), "x"),
])
def test_bad_specs_are_config_errors(make):
    with pytest.raises(ConfigError):
        make()


def test_profile_and_counts_build_host_specs(tmp_path):
    profile = tmp_path / "lab.toml"
    profile.write_text('[[host]]\nname = "seed"\nupload_mbit = 100\n\n'
                       '[[host]]\nname = "home1"\ndownload_mbit = 20.5\nnat = "g1"\n')
    assert load_profile(profile) == (HostSpec("seed", 100.0), HostSpec("home1", None, 20.5, "g1"))
    profile.write_text('[[host]]\nname = "seed"\nuplod_mbit = 100\n')
    with pytest.raises(ConfigError, match=r"host\[0\].uplod_mbit"):
        load_profile(profile)
    with pytest.raises(ConfigError, match="--profile"):
        load_profile(tmp_path / "missing.toml")
    assert hosts_from_counts(3, upload_mbit=50, nat_hosts=2) == (
        HostSpec("h1", 50.0), HostSpec("h2", 50.0, nat="nat1"), HostSpec("h3", 50.0, nat="nat2"))
    with pytest.raises(ConfigError, match="--nat-hosts"):
        hosts_from_counts(2, nat_hosts=3)


def test_cli_without_a_lab_prints_one_line_and_exits_2(tmp_path, capsys):
    assert main(["lab", "status", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no lab in" in err


# --- real labs --------------------------------------------------------------------------------

SERVER = r"""
import socket, time
s = socket.socket()
s.bind(("0.0.0.0", 0))
s.listen(8)
print(s.getsockname()[1], flush=True)
while True:
    c, (ip, _) = s.accept()
    t0, n = time.monotonic(), 0
    while (b := c.recv(1 << 16)):
        n += len(b)
    print(ip, n, time.monotonic() - t0, flush=True)
    c.close()
"""

CLIENT = r"""
import socket, sys
ip, port, nbytes, timeout_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
c = socket.create_connection((ip, port), timeout=timeout_s)
buf, left = bytes(1 << 16), nbytes
while left > 0:
    c.sendall(buf[:min(left, len(buf))])
    left -= min(left, len(buf))
c.shutdown(socket.SHUT_WR)
c.recv(1)
"""

DIAL = r"""
import socket, sys, time
t0 = time.monotonic()
try:
    socket.create_connection((sys.argv[1], 9), timeout=10)
    print("connected")
except OSError as exc:
    print(exc.errno, time.monotonic() - t0)
"""


class Lines:
    """Lines of a child's stdout, each awaited with a deadline (no sleeps, no unbounded reads)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.fd, self.buf = proc, proc.stdout.fileno(), b""

    def next(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0, f"no line from pid {self.proc.pid} within {timeout_s} s"
            if select.select([self.fd], [], [], left)[0]:
                chunk = os.read(self.fd, 4096)
                assert chunk, f"pid {self.proc.pid} exited (status {self.proc.poll()})"
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()


def start_server(lab: Lab, host: str) -> tuple[subprocess.Popen, Lines, int]:
    proc = lab.popen(host, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE)
    lines = Lines(proc)
    return proc, lines, int(lines.next(20))


def send(lab: Lab, host: str, ip: str, port: int, nbytes: int, timeout_s: float) -> None:
    lab.run(host, [sys.executable, "-c", CLIENT, ip, str(port), str(nbytes), str(timeout_s)],
            check=True, timeout=timeout_s + 10)


def leftovers(lab: Lab) -> list[str]:
    return sorted(ns for ns in existing_netns() if ns.startswith(f"p2pl-{lab.lab_id}"))


def test_hosts_reach_each_other_and_nat_hides_the_private_address(lab_factory):
    lab = lab_factory([HostSpec("a"), HostSpec("b"), HostSpec("n", nat="home")])
    assert len(leftovers(lab)) == 5
    server, lines, port = start_server(lab, "a")
    a, b, n = lab.hosts["a"], lab.hosts["b"], lab.hosts["n"]

    send(lab, "b", a.ip, port, 1000, timeout_s=10)
    assert lines.next(10).split()[:2] == [b.ip, "1000"]

    send(lab, "n", a.ip, port, 1000, timeout_s=10)
    assert lines.next(10).split()[:2] == [lab.routers["home"].public_ip, "1000"]
    assert n.public_ip == lab.routers["home"].public_ip != n.ip

    dial = lab.run("a", [sys.executable, "-c", DIAL, n.ip], capture_output=True, text=True, timeout=30, check=True)
    code, elapsed_s = dial.stdout.split()
    assert int(code) == errno.ENETUNREACH and float(elapsed_s) < 1.0

    lab.down()
    assert server.poll() is not None  # stopped and reaped by down()
    assert leftovers(lab) == []
    assert not (lab.state_dir / "lab.json").exists()
    lab.down()  # idempotent


def test_down_runs_when_the_body_raises(lab_factory):
    lab = lab_factory([HostSpec("a"), HostSpec("b")])
    sleeper = None
    with pytest.raises(RuntimeError, match="boom"):
        with lab:
            # started without lab.popen: down() must find it inside the namespace by itself; its
            # line comes once `ip netns exec` has entered the namespace (before, it may not have)
            sleeper = subprocess.Popen([*lab.wrap("a"), "sh", "-c", "echo in; exec sleep 60"], stdout=subprocess.PIPE)
            assert sleeper.stdout is not None and sleeper.stdout.readline() == b"in\n"
            assert lab.status()["hosts"][0]["processes"] == 1
            raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) == -signal.SIGTERM
    sleeper.stdout.close()
    assert leftovers(lab) == []


def test_cleanup_stale_removes_labs_of_dead_owners_only(lab_factory):
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    stale, kept = lab_factory([HostSpec("a")]), lab_factory([HostSpec("a")])
    for lab, owner in ((stale, dead.pid), (kept, None)):
        path = labmod.REGISTRY_DIR / f"{lab.lab_id}.json"
        record = json.loads(path.read_bytes())
        record["owner_pid"] = owner
        path.write_text(json.dumps(record))
    removed = cleanup_stale()
    assert sorted(n for n in removed if stale.lab_id in n) == sorted(stale.namespaces)
    assert leftovers(stale) == [] and not (stale.state_dir / "lab.json").exists()
    assert len(leftovers(kept)) == 2


def test_a_failed_up_removes_what_it_made_and_names_the_command(tmp_path, monkeypatch):
    if lab_unavailable() is not None:
        pytest.skip(lab_unavailable())
    spec = LabSpec((HostSpec("a"), HostSpec("b")), f"f{os.getpid()}")
    broken = [*setup_commands(spec), ["ip", "-n", f"p2pl-{spec.lab_id}-b", "link", "set", "nosuchdev", "up"]]
    monkeypatch.setattr(labmod, "setup_commands", lambda _spec: broken)
    with pytest.raises(labmod.LabError, match=r"`ip -n p2pl-f\d+-b link set nosuchdev up` failed \(exit \d+\): .+"):
        Lab.up(spec, tmp_path)
    assert not [ns for ns in existing_netns() if ns.startswith(f"p2pl-{spec.lab_id}")]
    assert not (labmod.REGISTRY_DIR / f"{spec.lab_id}.json").exists() and not (tmp_path / "lab.json").exists()


@pytest.mark.slow
def test_upload_and_download_limits_hold(lab_factory):
    lab = lab_factory([HostSpec("a", upload_mbit=40), HostSpec("b", download_mbit=40), HostSpec("c")])
    nbytes, rate_bytes_per_s = 8_000_000, 40e6 / 8
    timeout_s = 5 * nbytes / rate_bytes_per_s + 20
    for sender, receiver in (("a", "c"), ("c", "b")):
        _, lines, port = start_server(lab, receiver)
        send(lab, sender, lab.hosts[receiver].ip, port, nbytes, timeout_s)
        ip, got, elapsed_s = lines.next(timeout_s).split()
        assert (ip, int(got)) == (lab.hosts[sender].ip, nbytes)
        assert float(elapsed_s) >= 0.8 * nbytes / rate_bytes_per_s, (sender, receiver, elapsed_s)


def test_cli_up_exec_status_down(tmp_path, capfd):
    if lab_unavailable() is not None:
        pytest.skip(lab_unavailable())
    lab_dir, lab_id = tmp_path / "lab", f"c{os.getpid()}"
    try:
        assert main(["lab", "up", "--dir", str(lab_dir), "--hosts", "2", "--upload-mbit", "100", "--id", lab_id,
                     "--json"]) == 0
        status = json.loads(capfd.readouterr().out)
        assert [h["ip"] for h in status["hosts"]] == ["10.213.0.10", "10.213.0.11"] and status["owner_pid"] is None
        assert main(["lab", "exec", "--dir", str(lab_dir), "h2", "--", sys.executable, "-c",
                     "import socket; socket.create_connection(('10.213.0.10', 9), timeout=5)"]) == 1  # refused
        assert "ConnectionRefusedError" in capfd.readouterr().err
        assert main(["lab", "exec", "--dir", str(lab_dir), "h1", "--", "sh", "-c", "exit 7"]) == 7
        assert main(["lab", "status", "--dir", str(lab_dir)]) == 0
        table = [line.split() for line in capfd.readouterr().out.splitlines()]
        assert table[1][:3] == ["HOST", "IP", "SEEN"] and table[3][:3] == ["h2", "10.213.0.11", "10.213.0.11"]
        assert main(["lab", "down", "--dir", str(lab_dir)]) == 0
        assert not [ns for ns in existing_netns() if ns.startswith(f"p2pl-{lab_id}")]
    finally:
        if (lab_dir / "lab.json").exists():
            Lab.load(lab_dir).down()
