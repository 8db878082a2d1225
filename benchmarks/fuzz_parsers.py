"""Fuzz every parser that reads untrusted bytes: only named errors, none slow.

    PYTHONPATH=. .venv/bin/python benchmarks/fuzz_parsers.py [--n 100000] [--seed 0] [--only NAME] [--json]

Targets, each fed `--n` seeded inputs: the wire decoder (`p2pnet.wire.Codec.decode`), the
manifest parser (`relay.manifest.open_manifest`), the proof decoder
(`verify.toploc.decode_proof`), the safetensors header check
(`relay.safetensors_check.check_safetensors`) and the control-socket request parser
(`p2pnet.control.parse_request`). Inputs are mutations of valid samples: structure-aware
(CBOR and JSON trees with values replaced by hostile ones, keys duplicated or dropped, nesting
deepened, then re-encoded and, for frames, re-signed so the body decoder is reached) and
byte-wise (flips, truncations, splices, length fields changed), plus random bytes.

For each target: inputs, accepted, rejected per named error class, any other exception (must
be 0), and the slowest single input in ms (must be < 1000). The safetensors target also loads
every input with `safetensors.torch.load` and counts disagreements with the check (must be 0).
Exits 1 if any of those fails. tests/relay/test_safetensors_check.py reuses the generators.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import re
import struct
import sys
import time
import types
import typing
from collections import Counter
from typing import Any, Callable, Iterator, Sequence

import cbor2
import numpy as np
from numpy.random import Generator as Rng
NOW_S = 1_800_000_000.0

# -- JSON trees, including what json.dumps cannot write ---------------------------------------


class Obj(list):
    """A JSON object as (key, value) pairs: duplicates and order kept."""


class Raw(str):
    """A JSON literal written verbatim (NaN, -0, 1e400, a lone surrogate escape, deep nesting)."""


def dump(node: Any) -> str:
    if isinstance(node, Raw):
        return str(node)
    if isinstance(node, Obj):
        return "{" + ",".join(f"{dump(k)}:{dump(v)}" for k, v in node) + "}"
    if isinstance(node, list):
        return "[" + ",".join(dump(v) for v in node) + "]"
    return json.dumps(node)


def load_tree(text: str) -> Any:
    return json.loads(text, object_pairs_hook=Obj)


def pick(rng: Rng, items: list[Any]) -> Any:
    """A fresh copy of one of `items` (rng.choice would turn a mixed list into a numpy array)."""
    return copy.deepcopy(items[int(rng.integers(len(items)))])


def nested(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


HOSTILE_JSON: list[Any] = [
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"), Raw("-0"), Raw("1.0"), Raw("1e2"),
    Raw('"\\ud800"'), Raw('"\\udc00x"'), Raw('"\\ud83d\\ude00"'), Raw("1" * 400), Raw("-" + "9" * 30),
    -1, 0, 1, 7, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, 0.5, -0.0,
    None, True, False, "", "x", "F32", "F4", "BF16", "U64", "C64", "f32", "__metadata__", "\x00", "é" * 3,
    [], [0], [1, 2, 3], [[]], [0, 0], [0, 2**64 - 1], Obj(), Obj([("F32", None)]), Obj([("F32", 1)]),
    Obj([("a", "b")]), Obj([("k", 1)]), ["F32", [1], [0, 4]],
    nested(16), nested(17), nested(126), nested(127), nested(128), nested(1000), nested(20000),
]
HUGE_DIMS = [0, 1, 2, 3, 4, 2**31, 2**32, 2**62 - 1, 2**62, 2**63 - 1, 2**63, 3074457345618258602,
             3074457345618258603, 2**64 - 1]


def _slots(tree: Any) -> list[tuple[Any, int, bool]]:
    """Every (container, index, is_key) position in a tree, found without recursion."""
    out: list[tuple[Any, int, bool]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Obj):
            for i, (_, v) in enumerate(node):
                out += [(node, i, True), (node, i, False)]
                stack.append(v)
        elif isinstance(node, list) and not isinstance(node, Raw):
            for i, v in enumerate(node):
                out.append((node, i, False))
                stack.append(v)
    return out


def _get(slot: tuple[Any, int, bool]) -> Any:
    node, i, is_key = slot
    return node[i][0 if is_key else 1] if isinstance(node, Obj) else node[i]


def _put(slot: tuple[Any, int, bool], value: Any) -> None:
    node, i, is_key = slot
    if isinstance(node, Obj):
        k, v = node[i]
        node[i] = (value if isinstance(value, str) else str(value), v) if is_key else (k, value)
    else:
        node[i] = value


def mutate_tree(rng: Rng, tree: Any, extra: Sequence[Any] = ()) -> Any:
    """One structural change at a random place; returns the (possibly new) root."""
    slots = _slots(tree)
    if not slots:
        return pick(rng, HOSTILE_JSON + [Obj([("a", 1)])])
    slot = slots[rng.integers(len(slots))]
    node, i, _ = slot
    op = rng.integers(8)
    pool = HOSTILE_JSON + list(extra)
    if op <= 2:
        _put(slot, pick(rng, pool))
    elif op == 3 and isinstance(_get(slot), int) and not isinstance(_get(slot), bool):
        _put(slot, max(0, _get(slot) + int(pick(rng, [-8, -4, -2, -1, 1, 2, 4, 8]))))
    elif op == 4:
        node.insert(rng.integers(len(node) + 1), copy.deepcopy(node[i]))  # a duplicate key or element
    elif op == 5 and len(node) > 0:
        del node[i]
    elif op == 6 and isinstance(_get(slot), Obj):
        _put(slot, [v for _, v in _get(slot)])  # an object spelled as an array of its values
    else:
        node.insert(rng.integers(len(node) + 1), (str(pick(rng, pool)), pick(rng, pool))
                    if isinstance(node, Obj) else pick(rng, pool))
    return tree


def mutate_bytes(rng: Rng, blob: bytes, region: int | None = None) -> bytes:
    data = bytearray(blob)
    for _ in range(rng.integers(1, 5)):
        op = rng.integers(6)
        end = min(len(data), region or len(data))
        if op == 0 and end:
            data[rng.integers(end)] ^= 1 << rng.integers(8)
        elif op == 1 and end:
            data[rng.integers(end)] = rng.integers(256)
        elif op == 2:
            del data[rng.integers(len(data) + 1):]
        elif op == 3:
            at = rng.integers(len(data) + 1)
            data[at:at] = rng.bytes(rng.integers(1, 16))
        elif op == 4 and end:
            at = rng.integers(end)
            del data[at:at + rng.integers(1, 16)]
        else:
            data += data[rng.integers(len(data) + 1):][:64]
    return bytes(data)


# -- safetensors files ------------------------------------------------------------------------

DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
          "I32": 4, "U32": 4, "F32": 4, "C64": 8, "F64": 8, "I64": 8, "U64": 8, "F4": 0.5, "F8_E8M0": 1,
          "F6_E2M3": 0.75, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1}


def safetensors_sample(rng: Rng) -> bytes:
    """A valid (or nearly: a few dtypes the torch loader lacks) small safetensors file."""
    pairs, offset = [], 0
    names = list(DTYPES)
    for i in range(rng.integers(0, 5)):
        dtype = names[rng.integers(len(names))] if rng.random() < 0.3 else names[rng.integers(16)]
        shape = [int(rng.integers(0, 5)) if rng.random() < 0.85 else 0 for _ in range(rng.integers(0, 4))]
        nbytes = int(math.prod(shape) * DTYPES[dtype])
        info = Obj([("dtype", dtype), ("shape", shape), ("data_offsets", [offset, offset + nbytes])])
        pairs.append((f"t{i}.weight", info))
        offset += nbytes
    order = rng.permutation(len(pairs))
    header = Obj([pairs[j] for j in order])
    if rng.random() < 0.4:
        metadata = Obj([("format", "pt")]) if rng.random() < 0.9 else None
        header.insert(rng.integers(len(header) + 1), ("__metadata__", metadata))
    return _safetensors_file(dump(header) + " " * int(rng.integers(0, 8)), rng.bytes(offset))


def _safetensors_file(header_text: str, data: bytes, header_len: int | None = None) -> bytes:
    raw = header_text.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def mutate_safetensors(rng: Rng, blob: bytes) -> bytes:
    (n,) = struct.unpack("<Q", blob[:8])
    header_text, data = blob[8:8 + n].decode(), blob[8 + n:]
    op = rng.random()
    if op < 0.6:
        tree = load_tree(header_text)
        for _ in range(rng.integers(1, 4)):
            tree = _mutate_tensor(rng, tree) if rng.random() < 0.5 else mutate_tree(rng, tree, HUGE_DIMS)
        if rng.random() < 0.2:
            data = mutate_bytes(rng, data) if data else rng.bytes(rng.integers(0, 9))
        text = dump(tree)
        length = None if rng.random() < 0.9 else len(text.encode("utf-8", "surrogatepass")) + int(rng.integers(-3, 4))
        return _safetensors_file(text, data, None if length is not None and length < 0 else length)
    if op < 0.85:
        return mutate_bytes(rng, blob, region=8 + n if rng.random() < 0.8 else None)
    if op < 0.95:
        return struct.pack("<Q", int(pick(rng, [0, 1, 2, 100_000_001, 2**64 - 1, rng.integers(0, 300)]))) + rng.bytes(
            rng.integers(0, 300))
    return rng.bytes(rng.integers(0, 64))


def _mutate_tensor(rng: Rng, tree: Any) -> Any:
    """A tensor-aware change: a dimension, an offset, a dtype, a duplicate, an array spelling."""
    if not isinstance(tree, Obj) or not tree:
        return tree
    i = rng.integers(len(tree))
    name, info = tree[i]
    if not isinstance(info, Obj):
        return tree
    fields = dict(info)
    op = rng.integers(6)
    if op == 0 and isinstance(fields.get("shape"), list):
        shape = list(fields["shape"]) or [0]
        shape[rng.integers(len(shape))] = int(pick(rng, HUGE_DIMS[:10])) if rng.random() < 0.5 else 0
        if rng.random() < 0.5:
            shape.insert(rng.integers(len(shape) + 1), HUGE_DIMS[rng.integers(len(HUGE_DIMS))])
        fields["shape"] = shape
    elif op == 1 and isinstance(fields.get("data_offsets"), list) and len(fields["data_offsets"]) == 2:
        a, b = fields["data_offsets"]
        if type(b) is int and rng.random() < 0.5:
            fields["data_offsets"] = [a, max(0, b + int(rng.integers(-4, 5)))]
        else:
            fields["data_offsets"] = [b, a]
    elif op == 2:
        fields["dtype"] = list(DTYPES)[rng.integers(len(DTYPES))] if rng.random() < 0.8 else Obj([("F32", None)])
    elif op == 3:
        tree.insert(rng.integers(len(tree) + 1), (name, copy.deepcopy(info)))
    elif op == 4:
        tree[i] = (name, [fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")][:rng.integers(2, 4)])
        return tree
    else:
        fields = {"__metadata__" if rng.random() < 0.2 else "extra": pick(rng, HOSTILE_JSON),
                  **fields}
    tree[i] = (name, Obj(list(fields.items())))
    return tree


def safetensors_inputs(rng: Rng, n: int) -> Iterator[bytes]:
    for _ in range(n):
        blob = safetensors_sample(rng)
        yield blob if rng.random() < 0.1 else mutate_safetensors(rng, blob)


def torch_loads(blob: bytes) -> bool:
    """Whether the loader relay.loader uses reads `blob` (a Rust panic is a failure too)."""
    from safetensors.torch import load

    try:
        load(blob)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 -- the oracle: any failure, PanicException included, is "no"
        return False
    return True


# -- control requests -------------------------------------------------------------------------

CONTROL_COMMANDS = ("status", "announce", "checkpoint.fetch", "checkpoint.publish", "checkpoint.status")
CONTROL_SAMPLES = [
    '{"cmd": "status"}', '{"cmd": "announce", "text": "hello"}',
    '{"cmd": "checkpoint.fetch", "version": 3, "out_dir": "/tmp/out", "timeout_s": 600.0}',
    '{"cmd": "checkpoint.publish", "paths": ["/a/b.safetensors"], "model": "m", "version": 1, '
    '"previous_version": -1, "chunk_bytes": 4194304}',
]


def control_inputs(rng: Rng, n: int) -> Iterator[bytes]:
    for _ in range(n):
        text = CONTROL_SAMPLES[rng.integers(len(CONTROL_SAMPLES))]
        op = rng.random()
        if op < 0.1:
            yield text.encode()
        elif op < 0.65:
            tree = load_tree(text)
            for _ in range(rng.integers(1, 4)):
                tree = mutate_tree(rng, tree, list(CONTROL_COMMANDS))
            yield dump(tree).encode("utf-8", "surrogatepass")
        elif op < 0.9:
            yield mutate_bytes(rng, text.encode())
        elif op < 0.95:
            yield b'{"cmd": "status", "x": "' + b"a" * int(rng.integers(65000, 70000)) + b'"}'
        else:
            yield rng.bytes(rng.integers(0, 200))


# -- TOPLOC proofs ----------------------------------------------------------------------------


def proof_inputs(rng: Rng, n: int) -> Iterator[tuple[Any, Any]]:
    from verify.toploc import PRIME, encode_proof

    odd_counts = [0, -1, -2, -(2**40), 4097, 10**12, 1.5, True, None, "128", np.int64(3), float("nan")]
    for _ in range(n):
        k = int(rng.integers(1, 257))
        blob = encode_proof(int(rng.integers(1, PRIME + 1)), rng.integers(0, PRIME, k))
        op = rng.random()
        if op < 0.15:
            yield blob, k
        elif op < 0.55:
            yield mutate_bytes(rng, blob), k if rng.random() < 0.7 else k + int(rng.integers(-2, 3))
        elif op < 0.7:
            yield blob, odd_counts[rng.integers(len(odd_counts))]
        elif op < 0.85:
            word = bytearray(blob)
            at = 2 * int(rng.integers(k + 1))
            word[at:at + 2] = int(pick(rng, [0, PRIME, PRIME + 1, 65535])).to_bytes(2, "big")
            yield bytes(word), k
        else:
            odd = [None, "ab", [1, 2], memoryview(np.zeros(k + 1, dtype=np.uint16)), bytearray(blob), 3.5]
            yield odd[rng.integers(len(odd))], k


# -- signed frames (wire and manifests) -------------------------------------------------------


def _registered_kinds() -> dict[str, Any]:
    import p2pnet.handshake  # noqa: F401 -- every module that registers messages
    import p2pnet.messages  # noqa: F401
    import p2pnet.notices  # noqa: F401
    import relay.manifest  # noqa: F401
    import relay.messages  # noqa: F401
    import verify.messages  # noqa: F401
    from p2pnet.wire import _REGISTRY

    return dict(_REGISTRY)


def _random_field(rng: Rng, hint: Any, depth: int = 0) -> Any:
    """A value of the wire type `hint` (as the codec encodes it), mostly plausible."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return bool(rng.integers(2))
    if hint is int:
        return int(pick(rng, [0, 1, 2, 3, 32, -1, 2**63 - 1, 2**64 - 1, int(rng.integers(0, 1000))]))
    if hint is float:
        return float(pick(rng, [0.0, 1.5, -1.0, 1e300, float(rng.random())]))
    if hint is str:
        return "".join(chr(c) for c in rng.integers(97, 123, rng.integers(0, 12)))
    if hint is bytes:
        return rng.bytes(pick(rng, [0, 8, 32, 64, 100]))
    if origin in (typing.Union, types.UnionType):
        return None if rng.random() < 0.3 else _random_field(rng, next(a for a in args if a is not type(None)), depth)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return [_random_field(rng, args[0], depth + 1) for _ in range(rng.integers(0, 4 if depth < 3 else 1))]
    if origin is tuple:
        return [_random_field(rng, a, depth + 1) for a in args]
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return [_random_field(rng, hints[f.name], depth + 1) for f in dataclasses.fields(hint) if f.init]
    return None


def _valid_bodies() -> list[Any]:
    """Well-formed bodies whose wire form the frame fuzzer mutates (others start from random fields)."""
    from p2pnet.notices import Notice
    from relay.manifest import FileEntry, Manifest, TensorEntry

    tensor = TensorEntry("w", "F32", (2, 3), 100, 124)
    files = (FileEntry("a.safetensors", 124, 0, (tensor,)), FileEntry("b.safetensors", 10, 124, ()))
    digests = (b"\x01" * 32, b"\x02" * 32, b"\x03" * 32)
    return [Notice("n1", "hello"), Manifest("tiny", 2, 1, files, 64, 134, digests, 7)]


HOSTILE_CBOR: list[Any] = [None, True, 0, -1, 2**64, -(2**63) - 1, 2**64 - 1, float("nan"), float("inf"), 1.5, b"",
                           b"\x00" * 33, "", "x" * 5000, [], [[[[]]]], {}, {1: 2}, [0] * 1000, list(range(5))]


def frame_inputs(rng: Rng, n: int, kinds: list[str] | None = None) -> Iterator[bytes]:
    from p2pnet.identity import Identity
    from p2pnet.wire import DOMAIN, WIRE_VERSION

    identity = Identity.from_seed_text("fuzzer")
    registry = _registered_kinds()
    names = kinds or sorted(registry)
    ts_ms = int(NOW_S * 1000)
    valid = [b for b in _valid_bodies() if type(b).KIND in names]
    for _ in range(n):
        if valid and rng.random() < 0.5:
            body = pick(rng, valid)
            kind, fields = type(body).KIND, registry[type(body).KIND].to_wire(body)
        else:
            kind = names[rng.integers(len(names))]
            hints = typing.get_type_hints(registry[kind].cls)
            fields = [_random_field(rng, hints[f.name]) for f in dataclasses.fields(registry[kind].cls) if f.init]
        outer: list[Any] = [WIRE_VERSION, kind, identity.peer_id_bytes, ts_ms, fields]
        op = rng.random()
        if op < 0.5:
            for _ in range(rng.integers(0, 4)):
                outer = mutate_tree(rng, outer, HOSTILE_CBOR)
        payload = cbor2.dumps(outer)
        frame = payload + identity.sign(DOMAIN + payload)
        if op >= 0.5 and op < 0.85:
            frame = mutate_bytes(rng, frame)
        elif op >= 0.85:
            frame = rng.bytes(rng.integers(0, 300))
        yield frame


# -- the run ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    name: str
    inputs: Callable[[Rng, int], Iterator[Any]]
    parse: Callable[[Any], Any]
    named: tuple[type[BaseException], ...]
    oracle: Callable[[Any], bool] | None = None  # for the safetensors check: the loader


def targets() -> list[Target]:
    from p2pnet.control import RequestRefused, parse_request
    from p2pnet.errors import MessageRejected
    from p2pnet.identity import Identity
    from p2pnet.wire import Codec
    from relay.errors import ManifestRejected, NotSafetensors
    from relay.manifest import MANIFEST_KIND, open_manifest
    from relay.safetensors_check import check_safetensors
    from verify.errors import ProofError
    from verify.toploc import decode_proof

    codec = Codec(None)
    trusted = {Identity.from_seed_text("fuzzer").peer_id}
    return [
        Target("wire Codec.decode", frame_inputs, lambda f: codec.decode(f, NOW_S), (MessageRejected,)),
        Target("relay open_manifest", lambda rng, n: frame_inputs(rng, n, [MANIFEST_KIND]),
               lambda f: open_manifest(f, trusted_publishers=trusted, now_s=NOW_S), (ManifestRejected,)),
        Target("verify decode_proof", proof_inputs, lambda a: decode_proof(*a), (ProofError,)),
        Target("relay check_safetensors", safetensors_inputs, check_safetensors, (NotSafetensors,), torch_loads),
        Target("control parse_request", control_inputs, lambda line: parse_request(line, CONTROL_COMMANDS),
               (RequestRefused,)),
    ]


def run_target(target: Target, n: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    accepted, slowest_s, slowest_input = 0, 0.0, None
    rejected: Counter[str] = Counter()
    other: Counter[str] = Counter()
    reasons: Counter[str] = Counter()  # the stable reason code, where the error has one
    examples: dict[str, str] = {}
    disagree = 0
    disagree_examples: list[str] = []
    for item in target.inputs(rng, n):
        started = time.perf_counter()
        try:
            target.parse(item)
            ok = True
        except target.named as exc:
            rejected[type(exc).__name__] += 1
            reasons[_reason(exc)] += 1
            ok = False
        except Exception as exc:  # noqa: BLE001 -- what the fuzzer is for: counted and shown, never hidden
            other[type(exc).__name__] += 1
            examples.setdefault(type(exc).__name__, f"{exc!r}"[:200] + f" on {item!r}"[:300])
            ok = False
        elapsed = time.perf_counter() - started
        accepted += ok
        if elapsed > slowest_s:
            slowest_s, slowest_input = elapsed, f"{item!r}"[:120]
        if target.oracle is not None and target.oracle(item) != ok:
            disagree += 1
            if len(disagree_examples) < 5:
                disagree_examples.append(f"check {'passes' if ok else 'refuses'}: {item!r}"[:400])
    row = {"target": target.name, "inputs": n, "accepted": accepted, "rejected": dict(rejected),
           "reasons": dict(reasons.most_common(20)),
           "other_exceptions": dict(other), "other_examples": examples, "slowest_ms": round(1e3 * slowest_s, 2),
           "slowest_input": slowest_input}
    if target.oracle is not None:
        row.update(loader_disagreements=disagree, disagreement_examples=disagree_examples)
    return row


def _reason(exc: BaseException) -> str:
    """A rejection's stable code, or its message with names and numbers blanked."""
    code = getattr(exc, "reason", None)
    if code:
        return str(code)
    text = str(getattr(exc, "problem", None) or exc).removeprefix("not a safetensors file: ")
    return re.sub(r"'[^']*'|\d+", "#", text.split(" (")[0])[:60]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| parser | inputs | accepted | rejected (named error: count) | other exceptions | slowest ms | "
             "disagree with loader |", "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        rejected = ", ".join(f"{k}: {v}" for k, v in sorted(r["rejected"].items()))
        lines.append(f"| {r['target']} | {r['inputs']} | {r['accepted']} | {rejected} | "
                     f"{sum(r['other_exceptions'].values())} | {r['slowest_ms']:.1f} | "
                     f"{r.get('loader_disagreements', '-')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="inputs per parser (default 100000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="run only the targets whose name contains this")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    rows = []
    for i, target in enumerate(targets()):
        if args.only and args.only not in target.name:
            continue
        started = time.perf_counter()
        rows.append(run_target(target, args.n, args.seed + i) | {"wall_s": 0.0})
        rows[-1]["wall_s"] = round(time.perf_counter() - started, 1)
        print(f"{target.name}: done in {rows[-1]['wall_s']}s", file=sys.stderr)
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    bad = [r for r in rows if r["other_exceptions"] or r["slowest_ms"] >= 1000 or r.get("loader_disagreements")]
    for r in bad:
        print(f"FAILED {r['target']}: {r['other_examples']} {r.get('disagreement_examples', '')}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
