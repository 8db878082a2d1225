"""The submission id is the hash of the payload its worker signed, whichever version decodes it.

A validator or trainer one version apart from the worker decodes a submission with a newer
field ignored or an older one's missing field defaulted (the codec's evolution rule); a
re-encoding of that body would name the submission differently on every version, and a
verdict's ticket (a signature over the id) would then miss it."""

from __future__ import annotations

import blake3
import cbor2

from p2pnet.identity import Identity
from p2pnet.wire import DOMAIN, WIRE_VERSION, Codec, Envelope, spec_of
from verify.messages import (_ID_DOMAIN, UNDECLARED_STACK, Stack, Submission, rollout_record, submission_id,
                             submission_id_of)

NOW = 1_800_000_000.0
WORKER = Identity.from_seed_text("submission-id-worker")


def submission() -> Submission:
    rollouts = tuple(rollout_record(prompt_ids=[1, 5], output_ids=[7, 2], logprobs=[-0.5, -0.1],
                                    proofs=[b"\x01" * 258], stop_reason="eos", row=r) for r in range(2))
    return Submission(model="tiny", model_version=0, step=3, seed=99, task_seed=7, prompts_per_submission=1,
                      group_size=2, temperature=1.0, max_new_tokens=8, rollouts=rollouts, nonce=b"n" * 16,
                      stack=Stack("fp32", "torch", "cpu"))


def signed(fields: list) -> tuple[bytes, bytes]:
    """(frame, payload) as a worker of any version signs a submission with these fields."""
    payload = cbor2.dumps([WIRE_VERSION, "verify/submission", WORKER.peer_id_bytes, int(NOW * 1000), fields],
                          canonical=True)
    return payload + WORKER.sign(DOMAIN + payload), payload


def id_as_signed(payload: bytes) -> bytes:
    """The id every peer that declares exactly the payload's fields computes."""
    return blake3.blake3(_ID_DOMAIN + payload).digest()


def fields_of(body: Submission) -> list:
    return spec_of(body).to_wire(body)


def test_a_newer_workers_submission_is_named_by_its_payload_not_by_what_we_decoded():
    frame, payload = signed(fields_of(submission()) + ["a field of the next version"])
    envelope = Codec(None).decode(frame, NOW)
    assert envelope.body == submission()
    assert submission_id(envelope) == id_as_signed(payload)
    other_frame, other_payload = signed(fields_of(submission()) + ["another value of it"])
    assert submission_id(Codec(None).decode(other_frame, NOW)) == id_as_signed(other_payload) != id_as_signed(payload)
    in_process = Envelope(envelope.kind, envelope.sender, envelope.sender_bytes, envelope.ts_ms, envelope.body, 0)
    assert submission_id(in_process) != submission_id(envelope)  # the re-encoding lacks the newer field


def test_an_older_workers_submission_keeps_the_id_older_peers_give_it():
    frame, payload = signed(fields_of(submission())[:-1])  # before `stack` existed
    envelope = Codec(None).decode(frame, NOW)
    assert envelope.body.stack == UNDECLARED_STACK
    assert submission_id(envelope) == id_as_signed(payload)


def test_an_envelope_built_in_process_has_the_id_of_its_encoding():
    """The simulator without signatures hands cores envelopes that were never encoded."""
    frame = Codec(WORKER).encode(submission(), NOW)
    envelope = Codec(None).decode(frame, NOW)
    assert envelope.payload == frame[:-64]
    in_process = Envelope(envelope.kind, envelope.sender, envelope.sender_bytes, envelope.ts_ms, envelope.body, 0)
    assert submission_id(in_process) == submission_id(envelope) == id_as_signed(frame[:-64])


def test_a_worker_knows_the_id_of_the_frame_it_encoded():
    frame = Codec(WORKER).encode(submission(), NOW)
    assert submission_id_of(frame) == submission_id(Codec(None).decode(frame, NOW))
    newer, _ = signed(fields_of(submission()) + [1])
    assert submission_id_of(newer) == submission_id(Codec(None).decode(newer, NOW)) != submission_id_of(frame)
