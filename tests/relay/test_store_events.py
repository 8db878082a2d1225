"""What the chunk store tells its owner: chunks found rotten, versions collected, stamps that say
a version's files changed, room for one more chunk, and the pure backoff for a full store."""

import threading

import pytest

import numpy as np
from safetensors.numpy import save_file

from p2pnet.identity import Identity
from relay.errors import ChunkMissing, VersionUnknown
from relay.store import ChunkRotten, ChunkStore, StoreBackoff, StoreTrouble, VersionCollected
from tests.relay.disk import rot_chunk

TRAINER = Identity.from_seed_text("trainer")


def open_store(root, **kwargs) -> ChunkStore:
    kwargs.setdefault("budget_bytes", 10**9)
    return ChunkStore(root, trusted_publishers=[TRAINER.peer_id], fsync=False, **kwargs)


def publish(store: ChunkStore, tmp_path, version: int):
    path = tmp_path / f"v{version}.safetensors"
    save_file({"w": np.random.default_rng(version).standard_normal(2000).astype(np.float32)}, str(path))
    return store.publish_files(TRAINER, [path], model="m", version=version, previous_version=version - 1,
                               chunk_bytes=1024, now_s=1_800_000_000.0)


def listening(store) -> list:
    heard: list = []
    lock = threading.Lock()

    def listener(event) -> None:
        with lock:
            heard.append(event)

    store.listener = listener
    return heard


def test_a_rotten_chunk_is_told_once_and_its_version_is_incomplete(tmp_path):
    store = open_store(tmp_path / "store")
    signed = publish(store, tmp_path, 1)
    heard = listening(store)
    rot_chunk(store, 1, 2)
    with pytest.raises(ChunkMissing):
        store.export_version(1, tmp_path / "out")
    assert heard == [ChunkRotten(1, 2)]
    assert store.complete_versions() == [] and store.missing(signed) == [2]
    with pytest.raises(ChunkMissing):  # not held any more: nothing more to tell
        store.read_chunk(1, 2)
    assert heard == [ChunkRotten(1, 2)]


def test_collected_versions_are_told(tmp_path):
    store = open_store(tmp_path / "store", keep_versions=2)
    heard = listening(store)
    for version in (1, 2, 3):
        publish(store, tmp_path, version)  # each publish may collect
    store.collect()
    assert [e for e in heard if isinstance(e, VersionCollected)] == [VersionCollected(1)]
    assert store.versions() == [2, 3]


def test_the_stamp_changes_only_when_a_chunk_of_the_version_is_stored_again(tmp_path):
    store = open_store(tmp_path / "store")
    signed = publish(store, tmp_path, 1)
    other = publish(store, tmp_path, 2)
    before = store.version_stamp(1)
    assert store.version_stamp(1) == before
    last = len(signed.manifest.chunk_digests) - 1
    data = store.read_chunk(1, last)
    assert not store.put_chunk(1, last, data) and store.version_stamp(1) == before  # already held
    rot_chunk(store, 1, last)
    with pytest.raises(ChunkMissing):
        store.read_chunk(1, last)
    store.put_chunk(1, last, data)  # fetched again
    assert store.version_stamp(1) != before
    assert store.version_stamp(1)[0] == signed.manifest_id and store.version_stamp(2)[0] == other.manifest_id
    reopened = open_store(tmp_path / "store")
    assert reopened.version_stamp(1)[0] == signed.manifest_id
    with pytest.raises(VersionUnknown):
        store.version_stamp(9)


def test_has_room_counts_the_budget_after_collecting(tmp_path):
    store = open_store(tmp_path / "store", keep_versions=1)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)  # under budget: nothing collected yet
    both = store.used_bytes
    store.budget_bytes = both + 10
    assert store.has_room(10) and store.versions() == [1, 2]
    assert store.has_room(both // 2)  # only once version 1 is collected
    assert store.versions() == [2] and store.used_bytes == both // 2
    assert not store.has_room(both)


def test_store_backoff_doubles_per_failed_probe_up_to_its_cap_and_says_so_once_per_hold():
    backoff = StoreBackoff(first_s=1.0, max_s=8.0)
    assert not backoff.active
    assert backoff.failed(0.0) == 1.0
    assert backoff.failed(0.5) is None and backoff.failed(0.99) is None  # requests that were already out
    holds = []
    now = 1.0
    for _ in range(6):  # each probe at the end of a hold fails again
        until = backoff.failed(now)
        holds.append(until - now)
        now = until
    assert holds == [2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert backoff.active and backoff.failures == 9
    assert backoff.to_json(now - 3.0)["retry_in_s"] == 3.0
    assert backoff.succeeded() and not backoff.active and not backoff.succeeded()
    assert backoff.failed(now) == now + 1.0  # a new episode starts short again


def test_store_backoff_keeps_the_cause_of_the_hold_a_failure_inside_it_does_not_change():
    backoff = StoreBackoff(first_s=1.0, max_s=8.0)
    assert backoff.cause is None and backoff.to_json(0.0)["cause"] is None
    assert backoff.failed(0.0, StoreTrouble.FAILING) == 1.0
    assert backoff.failed(0.5, StoreTrouble.FULL) is None  # a request already out found the store full
    assert backoff.cause is StoreTrouble.FAILING and backoff.to_json(0.5)["cause"] == "failing"
    assert backoff.failed(1.0) == 3.0 and backoff.cause is StoreTrouble.FULL  # the next hold is its own
    assert backoff.succeeded() and backoff.cause is None and backoff.to_json(3.0)["cause"] is None
