"""relay: signed, sharded checkpoints that peers relay to each other.

A trainer publishes a checkpoint as a signed `Manifest` (relay.manifest): the safetensors files
concatenated and cut into fixed-size chunks, each named by its blake3 digest. Peers keep chunks
in a content-addressed `ChunkStore` (relay.store), fetch the ones they miss from each other
(relay.planner, relay.transfer, relay.role) and load a complete version into torch
(relay.loader, the only module that imports torch). `p2pnet checkpoint ...` is relay.cli.

This package must not trust any byte it has not hashed, nor import torch outside the loader.
"""
