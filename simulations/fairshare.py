"""Two-sided max-min fair rates for the simulated data plane's flows (`simulations.dataplane`).

`share(flows, ...)` gives each of `flows` a rate by progressive filling over the resources they
use: every port's upload and every limited download. All rates rise together; a flow stops at
its own cap (its connection's window / round trip) or at what a resource it alone is rated on
leaves it, and all rising flows of a resource stop when it is full. Flows of those resources
that are not in `flows` keep their rates and count as load (`load`), so nothing is
oversubscribed. Then each flow whose rate changed by more than a billionth is rescheduled.

Works on the data plane's `_Flow` and `_Port` objects through their scratch fields (`mark`,
`limit`, `level`; `up_tag`, `up_count`, `up_use`, `up_load` and the `down_` ones), so a call
costs O(len(flows)) plus the filling, with no lookups by id.

`share` is `python_share` below, or where it is built (`python -m simulations.accel`) the same
function in C (`simulations/_cfairshare.c`: the same float operations in the same order, so a run
gives the same bytes; about half of a big run's time is this function). The C one is used only
where CPython's float `sum()` adds in order, as the C one does (before 3.12), not with
`P2PNET_SIM_PURE=1` in the environment, and only while the built module's stamp (`stamp()`: the C
source and `python_share`'s source, hashed) matches this tree: a stale build is ignored with a
warning. results.json records which one ran (`fair_share`: "c" or "python",
`simulations.hostile.fair_share_implementation`).
"""

from __future__ import annotations

import inspect
import math
import sys
from pathlib import Path
from operator import attrgetter
from typing import Any, Callable

from p2pnet import cbuild


def python_share(flows: list[Any], tag: int, engine: Any, finish: Callable[..., Any]) -> None:
    """Two-sided max-min fair rates for `flows`, by progressive filling: every flow's rate rises
    together; a flow stops at its connection cap, and all flows of a resource (an upload or a
    limited download) stop when it is full. Flows of the resources these touch that are not in
    `flows` keep their rates: they count as load, so a resource is never oversubscribed, and the
    capacity they would gain waits for their own next event. A resource only one of `flows`
    uses is one more cap for that flow; only resources two or more share are filled."""
    inf = math.inf
    for flow in flows:  # count the flows on each resource
        flow.level = -1.0
        src = flow.src
        if src.up_tag == tag:
            src.up_count += 1
        else:
            src.up_tag, src.up_count, src.up_use = tag, 1, None
        dst = flow.dst
        if dst.download_bps != inf:
            if dst.down_tag == tag:
                dst.down_count += 1
            else:
                dst.down_tag, dst.down_count, dst.down_use = tag, 1, None
    # a shared resource: [capacity, port, is a download, its flows among `flows`, rate given to
    # those stopped so far, how many still rise, the level they all stop at when it is full (inf:
    # none rises)]
    shared = []
    for flow in flows:
        limit = flow.cap
        src = flow.src
        if src.up_count == 1:
            if len(src.up) == 1:
                left = src.upload_bps
            else:
                used = src.up_load
                if used < 0.0:
                    used = load(src, True)
                left = src.upload_bps - used + flow.rate
            if left < limit:
                limit = left if left > 0.0 else 0.0
        else:
            use = src.up_use
            if use is None:
                src.up_use = use = [src.upload_bps, src, False, [flow], 0.0, src.up_count, inf]
                shared.append(use)
            else:
                use[3].append(flow)
        dst = flow.dst
        if dst.down_tag == tag:
            if dst.down_count == 1:
                if len(dst.down) == 1:
                    left = dst.download_bps
                else:
                    used = dst.down_load
                    if used < 0.0:
                        used = load(dst, False)
                    left = dst.download_bps - used + flow.rate
                if left < limit:
                    limit = left if left > 0.0 else 0.0
            else:
                use = dst.down_use
                if use is None:
                    dst.down_use = use = [dst.download_bps, dst, True, [flow], 0.0, dst.down_count, inf]
                    shared.append(use)
                else:
                    use[3].append(flow)
        flow.limit = limit
    for use in shared:  # what the flows of a shared resource that are not in `flows` leave them
        port, mine = use[1], use[3]
        if len(mine) != len(port.down if use[2] else port.up):
            left = use[0] - (load(port, not use[2]) - sum([f.rate for f in mine]))
            use[0] = left if left > 0.0 else 0.0
    if shared:
        for use in shared:
            use[6] = (use[0] - use[4]) / use[5]
        order = sorted(flows, key=_LIMIT)
        active, i = len(order), 0
        while active:
            while order[i].level >= 0.0:
                i += 1
            at_full, full = inf, None
            for use in shared:
                if use[6] < at_full:
                    at_full, full = use[6], use
            if full is None:  # no shared resource still rises: every flow left stops at its cap
                for flow in order[i:]:
                    if flow.level < 0.0:
                        flow.level = flow.limit
                break
            flow = order[i]
            level = flow.limit
            if level <= at_full:
                stopping = [flow]
            else:
                stopping = [f for f in full[3] if f.level < 0.0]
                level = at_full if at_full > 0.0 else 0.0
            for flow in stopping:
                flow.level = level
                active -= 1
                use = flow.src.up_use
                if use is not None:
                    use[4] += level
                    rising = use[5] = use[5] - 1
                    use[6] = (use[0] - use[4]) / rising if rising else inf
                dst = flow.dst
                if dst.down_tag == tag:
                    use = dst.down_use
                    if use is not None:
                        use[4] += level
                        rising = use[5] = use[5] - 1
                        use[6] = (use[0] - use[4]) / rising if rising else inf
    else:
        for flow in flows:
            flow.level = flow.limit
    now = engine.now
    at, retime = engine.at, engine.retime
    for flow in flows:  # `_set_rate`, inline
        rate, old, handle = flow.level, flow.rate, flow.handle
        if handle is not None:
            if abs(rate - old) <= 1e-9 * old:
                continue
            flow.remaining -= (now - flow.since) * old
        elif rate == 0.0:
            continue
        flow.since = now
        flow.rate = rate
        flow.src.up_load = -1.0
        flow.dst.down_load = -1.0
        if rate > 0.0:
            remaining = flow.remaining
            when = now + (remaining if remaining > 0.0 else 0.0) / rate
            flow.handle = at(when, finish, flow) if handle is None else retime(handle, when, finish, flow)
        elif handle is not None:
            handle.cancel()
            flow.handle = None


def load(port: Any, up: bool) -> float:
    """The sum of the rates of `port`'s uploads (`up`) or downloads, summed afresh only after one
    changed (a cache: every rate change and every flow added or removed clears it)."""
    if up:
        load = port.up_load
        if load < 0.0:
            load = port.up_load = sum([f.rate for f in port.up])
    else:
        load = port.down_load
        if load < 0.0:
            load = port.down_load = sum([f.rate for f in port.down])
    return load


_LIMIT = attrgetter("limit")


def stamp() -> str:
    """What a built C module must carry to be used: sha256 of `_cfairshare.c`, `_cqueue.c` (the
    engine's queue, in the same module) and `python_share`'s source, so changing any makes an
    older build stale."""
    here = Path(__file__)
    return cbuild.digest([here.with_name("_cfairshare.c"), here.with_name("_cqueue.c")], inspect.getsource(python_share))


def accelerator() -> Any:
    """The built C module (`_cfairshare`: this `share` and the engine's `Queue`), where it is built
    from this tree and gives the Python code's bytes (see the top); None otherwise."""
    if sys.version_info >= (3, 12):
        return None
    return cbuild.load("simulations", "_cfairshare", stamp, "P2PNET_SIM_PURE", "make sim-accel")


# looked up once per process (the stamp hashes the sources): this module's `share` and the
# engine's queue both come from it
ACCELERATOR: Any = accelerator()
share: Callable[..., None] = python_share if ACCELERATOR is None else ACCELERATOR.share
