"""Errors raised by the verify package.

Owns: the one exception type that says "the submitter sent something malformed".
Must not: carry any policy; a well-formed proof that fails its checks is a verdict, not an
error. Our own bugs stay ordinary exceptions (TypeError, AssertionError...) so they are
never mistaken for a peer's fault.
"""

from __future__ import annotations

__all__ = ["ProofError"]


class ProofError(ValueError):
    """A proof or a rollout input is malformed: the submitter's fault.

    Raised for wrong byte lengths, missing proofs, a proof count that does not match the
    number of chunks, hidden states of the wrong dtype or shape, out-of-range token ids.
    Callers turn it into a rejection (reason code ``malformed_proof``) and a score penalty.
    """
