"""Closed forms the simulator is checked against, and the bounds experiments are plotted against.

Broadcast (all sizes in bytes, rates in bytes/s). A checkpoint of m chunks of c bytes goes
from an origin to N peers over links of upload U (downloads unlimited), one request in flight
per link, one-way request latency l:

- pipelined chain (origin -> p1 -> ... -> pN): every hop forwards a chunk as soon as it has
  verified it. The first chunk reaches the end after N transmissions; after that one chunk
  arrives every c/U + l (each chunk waits one request latency on each link):
  T_chain = N*c/U + (m - 1)*(c/U + l) + l.
- pipelined k-ary tree of depth d (the origin and every interior peer feed k children at U/k
  each): the same with a transmission time of k*c/U and d hops:
  T_tree = d*k*c/U + (m - 1)*(k*c/U + l) + l.
  A tree with k = N is the star: T_star = N*S/U (+ latency).
- the lower bound for any schedule (DESIGN.md principle 4, `relay.planner.lower_bound_s`):
  max(S/U_origin, N*S/(U_origin + sum of uploads)).

Audit. A cheater's forged submission is caught when some validator is drawn for it (the
network-wide sample rate r, exact by construction in `verify.assign`) and that check detects
the forgery (probability d): q = r*d per submission, independently. Then
P(caught within k submissions) = 1 - (1 - q)^k, and with a ban after b failed batches the
expected number of forged batches accepted among the first K follows from a short recursion.

Pure functions only.
"""

from __future__ import annotations

from relay.planner import lower_bound_s

__all__ = ["chain_time_s", "tree_depth", "tree_time_s", "star_time_s", "lower_bound_s", "catch_probability",
           "expected_accepted_forgeries"]


def chain_time_s(peers: int, chunks: int, chunk_bytes: float, upload_bps: float, latency_s: float = 0.0) -> float:
    """Time for the last peer of a pipelined chain to hold every chunk."""
    return tree_time_s(peers, chunks, chunk_bytes, upload_bps, 1, latency_s)


def tree_depth(peers: int, fanout: int) -> int:
    """Levels below the origin of a complete `fanout`-ary tree holding `peers` peers."""
    if peers < 1:
        return 0
    if fanout == 1:
        return peers
    depth, level, placed = 0, 1, 0
    while placed < peers:
        level *= fanout
        placed += level
        depth += 1
    return depth


def tree_time_s(peers: int, chunks: int, chunk_bytes: float, upload_bps: float, fanout: int,
                latency_s: float = 0.0) -> float:
    """Time for the deepest peer of a pipelined `fanout`-ary tree to hold every chunk.

    Every parent (the origin included) serves its k = min(fanout, peers) children at once, so
    one chunk takes k*c/U on each link; the last level may be partly filled but its parents
    still serve k children except in a tree of one level (then k = peers)."""
    k = min(fanout, peers)
    hop_s = k * chunk_bytes / upload_bps
    depth = tree_depth(peers, fanout)
    return depth * hop_s + (chunks - 1) * (hop_s + latency_s) + latency_s


def star_time_s(peers: int, total_bytes: float, origin_upload_bps: float) -> float:
    """Everyone pulls from the origin: N*S/U_origin."""
    return peers * total_bytes / origin_upload_bps


def catch_probability(sample_rate: float, detection_rate: float, submissions: int) -> float:
    """P(at least one of `submissions` forged submissions is checked and detected)."""
    q = sample_rate * detection_rate
    return 1.0 - (1.0 - q) ** submissions


def expected_accepted_forgeries(sample_rate: float, detection_rate: float, submissions: int,
                                ban_after_failures: int = 1) -> float:
    """Expected forged batches accepted among `submissions`, with a ban after `ban_after_failures`
    caught ones (submissions after the ban are refused). A forged batch is accepted unless it is
    caught (q = rate*detection), as an unchecked batch is accepted by a sampling network."""
    q = sample_rate * detection_rate
    # alive[f] = P(f failures so far and not banned yet)
    alive = [0.0] * ban_after_failures
    alive[0] = 1.0
    expected = 0.0
    for _ in range(submissions):
        expected += sum(alive) * (1.0 - q)
        nxt = [0.0] * ban_after_failures
        for f, p in enumerate(alive):
            nxt[f] += p * (1.0 - q)
            if f + 1 < ban_after_failures:
                nxt[f + 1] += p * q
        alive = nxt
    return expected
