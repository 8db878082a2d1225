"""What py-libp2p 0.8.1's AutoNAT says about peers that cannot be dialled, measured in the lab.

    sudo .venv/bin/python scripts/autonat_check.py

Builds a lab of three hosts (`srv` public, `pub` public, `nat` behind NAT), runs a libp2p host
with py-libp2p's `AutoNATService` on `srv`, and asks it from the other two to dial back:

1. `nat`, advertising its interface (private) address: the NAT case;
2. `pub`, advertising its own IP with a port nobody listens on: the case of a public IP whose
   port is not forwarded or is firewalled;
3. `pub`, advertising its real listen address: the reachable case.

For each it prints the AutoNAT answer next to the truth (is anything listening there that the
server could reach with a new connection?). `p2pnet.reachability` exists because of case 2.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SERVER_PORT = 4101


def _host(seed: str, listen: str):
    from p2pnet.identity import Identity
    from p2pnet.host import open_host

    return open_host(Identity.from_seed_text(seed), listen)


async def serve() -> None:
    import trio
    from libp2p.host.autonat import AutoNATService

    async with _host("autonat-server", f"/ip4/0.0.0.0/tcp/{SERVER_PORT}") as host:
        AutoNATService(host._host, serve=True)
        print(json.dumps({"peer_id": host.peer_id}), flush=True)
        await trio.sleep_forever()


async def ask(server: str, advertise: str) -> None:
    import multiaddr
    from libp2p.host.autonat import AutoNATService
    from libp2p.host.autonat.pb.autonat_pb2 import Message
    from libp2p.peer.id import ID

    async with _host(f"client-{secrets.token_hex(4)}", "/ip4/0.0.0.0/tcp/0") as host:
        server_id = await host.connect(server)
        addrs = [a if a != "REAL" else host.addrs()[0].split("/p2p/")[0] for a in advertise.split(",")]
        status, _ = await AutoNATService(host._host, serve=False).query_server(
            ID.from_base58(server_id), [multiaddr.Multiaddr(a).to_bytes() for a in addrs], timeout=20)
        print(json.dumps({"advertised": addrs, "status": Message.ResponseStatus.Name(status)}), flush=True)


def main() -> int:
    from p2pnet.lab import HostSpec, Lab, LabSpec, nat_unavailable

    reason = nat_unavailable()
    if reason:
        print(reason)
        return 2
    me = [sys.executable, str(Path(__file__).resolve())]
    with tempfile.TemporaryDirectory() as tmp, \
            Lab.up(LabSpec((HostSpec("srv"), HostSpec("pub"), HostSpec("nat", nat="home")),
                           f"an{secrets.token_hex(3)}"), Path(tmp)) as lab:
        server = lab.popen("srv", [*me, "serve"], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None  # stdout=PIPE
        try:
            server_id = json.loads(server.stdout.readline())["peer_id"]
            server_addr = f"/ip4/{lab.host('srv').ip}/tcp/{SERVER_PORT}/p2p/{server_id}"
            cases = [
                ("nat", "REAL", False, "behind NAT, advertising its private address"),
                ("pub", f"/ip4/{lab.host('pub').ip}/tcp/9", False, "public IP, port not open (firewalled)"),
                ("pub", "REAL", True, "public IP, real listen address"),
            ]
            for host, advertise, truth, what in cases:
                out = lab.run(host, [*me, "ask", server_addr, advertise], capture_output=True, text=True,
                              timeout=60)
                answer = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else out.stderr[-300:]
                print(f"{what:45}  dialable: {str(truth):5}  AutoNAT: {answer}")
        finally:
            server.terminate()
            server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("serve", "ask"):
        import trio

        trio.run(serve) if sys.argv[1] == "serve" else trio.run(ask, sys.argv[2], sys.argv[3])
        sys.exit(0)
    import argparse  # (the lab's own processes above take positional words, not flags)

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())
