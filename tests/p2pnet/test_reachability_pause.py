"""The dial-back client's pause between its looks for peers to ask (`p2pnet.reachability`, `pause_s`):
pure, no network."""

from p2pnet.reachability import NO_PEERS_RETRY_S, UNKNOWN_RETRY_S, pause_s


def test_a_peer_with_no_connection_and_no_verdict_looks_again_soon_for_one_to_ask():
    """The dial-back client's pause: with nobody connected and no verdict yet it looks again within
    `NO_PEERS_RETRY_S`, not `UNKNOWN_RETRY_S` (a relay started a moment before a trainer published
    heard the relays dialled back ~3 s after, not ~1 s); otherwise as before."""
    assert pause_s(connected=False, verdict=None, interval_s=60.0) == NO_PEERS_RETRY_S < UNKNOWN_RETRY_S
    assert pause_s(connected=True, verdict=None, interval_s=60.0) == UNKNOWN_RETRY_S
    assert pause_s(connected=False, verdict=True, interval_s=60.0) == 60.0
    assert pause_s(connected=True, verdict=False, interval_s=60.0) == 60.0
