"""p2pnet: the peer of a peer-to-peer network for decentralized reinforcement-learning training.

This package owns identity, configuration, wire messages and their codec, the libp2p host and
gossip, the CLI and the wiring of roles into one process. It does not know how checkpoints,
proofs or training work inside: those live in `relay`, `verify` and `trainer`.
"""

__version__ = "0.1.0"
