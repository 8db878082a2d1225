"""verify: TOPLOC proofs, seeded-sampling replay, the accept/reject policy.

Owns: building and measuring proofs from hidden states handed in by the caller, replaying
seeded sampling, and deciding. Must not: load or run a model itself (callers pass hidden
states or a ``forward`` callable), touch sockets, files or clocks in its cores.
"""
