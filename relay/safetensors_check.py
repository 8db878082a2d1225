"""The safetensors header check at publish: exactly as strict as the loader that will read it.

Owns: deciding, from a file's header and size alone, whether `safetensors.torch.load` (the
loader `relay.loader` and the trainer use; safetensors 0.8 with torch >= 2.3) will load the
file, and listing its tensors if so. For any bytes, `check_safetensors(blob)` passes if and
only if that loader loads `blob`; tests and `benchmarks/fuzz_parsers.py` check this on
mutated files. A file that would fail to load is refused when it is published, not on every
worker after it has been relayed. Must not: import torch or safetensors, read tensor data,
or do I/O except reading the header from the file object it is handed.

What the loader requires (safetensors' Rust `read_metadata`, serde_json, then torch):

- 8 bytes: header length n (u64 little-endian), n <= 100,000,000, 8 + n <= file size;
- the header: UTF-8, one JSON object (serde_json: no NaN/Infinity, no number that overflows a
  float, no unpaired UTF-16 surrogate escape, nesting at most 127 deep);
- `__metadata__` (at most once): null or an object of string values;
- every other key is a tensor: an object with `dtype`, `shape`, `data_offsets` (each at most
  once, other keys ignored) or an array of exactly those three; a repeated tensor name keeps
  the last entry, but every entry must be well typed;
- dtype: a safetensors dtype name, or serde's other spelling of an enum, `{"F32": null}`;
  shape: non-negative integers below 2**64; data_offsets: two of them;
- the tensors that count (the last of each name) have a dtype the torch loader knows (F4,
  F6_*, F8_E8M0 parse but do not load);
- sorted by (begin, end), the tensors tile the data exactly: each begins where the last ended,
  end >= begin, end - begin = product(shape) * element bytes (computed in u64, refused on
  overflow, left to right), and the last end + 8 + n is the file size;
- a tensor with no bytes (a zero in its shape) is built by `torch.empty(shape)`: every
  dimension <= 2**63 - 1 and its contiguous strides (products of max(dim, 1) from the right)
  <= 2**63 - 1.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from p2pnet.jsonlimits import exceeds_depth
from relay.errors import NotSafetensors

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
MAX_JSON_DEPTH = 127  # serde_json's recursion limit refuses the 128th nested array/object
METADATA_KEY = "__metadata__"
TENSOR_FIELDS = ("dtype", "shape", "data_offsets")
U64_MAX = 2**64 - 1
I64_MAX = 2**63 - 1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

DTYPE_BYTES = {  # what safetensors.torch.load maps to a torch dtype, and its element size
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
    "C64": 8, "F64": 8, "I64": 8, "U64": 8,
}
PARSED_ONLY_DTYPES = ("F4", "F6_E2M3", "F6_E3M2", "F8_E8M0")  # safetensors parses them; torch loading fails


@dataclass(frozen=True, slots=True)
class HeaderTensor:
    """One tensor of a checked header; [begin, end) are offsets into the data after the header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def check_safetensors(blob: bytes, path: object = "<bytes>") -> tuple[HeaderTensor, ...]:
    """The tensors of a whole safetensors file held in memory; NotSafetensors if it would not load."""
    header_len = _header_length(bytes(blob[:8]), len(blob), path)
    return check_header(bytes(blob[8:8 + header_len]), len(blob), path)


def read_safetensors_header(fh: BinaryIO, size: int, path: object = "<file>") -> tuple[HeaderTensor, ...]:
    """The same check, reading only the header from `fh` (positioned at 0) of a `size`-byte file."""
    header_len = _header_length(fh.read(8), size, path)
    raw = fh.read(header_len)
    if len(raw) != header_len:
        raise NotSafetensors(path, "the file ended inside its header (did it change while being read?)")
    return check_header(raw, size, path)


def _header_length(head: bytes, size: int, path: object) -> int:
    if len(head) < 8:
        raise NotSafetensors(path, "shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > MAX_HEADER_BYTES:
        raise NotSafetensors(path, f"header length {header_len} exceeds {MAX_HEADER_BYTES}")
    if 8 + header_len > size:
        raise NotSafetensors(path, f"header length {header_len} exceeds the {size}-byte file")
    return header_len


def check_header(raw: bytes, size: int, path: object = "<bytes>") -> tuple[HeaderTensor, ...]:
    """Check header bytes `raw` of a `size`-byte file; its tensors in data order."""
    pairs = _parse_json(raw, path)
    tensors: dict[str, HeaderTensor] = {}
    seen_metadata = False
    for name, value in pairs:
        if name == METADATA_KEY:
            if seen_metadata:
                raise NotSafetensors(path, f"{METADATA_KEY} appears twice")
            seen_metadata = True
            _check_metadata(value, path)
        else:
            tensors[name] = _tensor(name, value, path)  # a repeated name keeps the last entry
    ordered = sorted(tensors.values(), key=lambda t: (t.begin, t.end))
    offset = 0
    for t in ordered:
        _check_tensor_bytes(t, offset, path)
        offset = t.end
    held = size - 8 - len(raw)
    if offset > held:
        raise NotSafetensors(path, f"tensor data ({offset} bytes) lies beyond the end of the file ({held} bytes)")
    if offset < held:
        raise NotSafetensors(path, f"tensors cover {offset} data bytes, the file holds {held}")
    return tuple(ordered)


# -- JSON, as serde_json reads it -------------------------------------------------------------


class _Object(list):
    """A JSON object as its (key, value) pairs, in order, duplicates kept."""


class _Refused(ValueError):
    """serde_json would refuse this text (a number it cannot hold, NaN, a lone surrogate)."""


def _parse_json(raw: bytes, path: object) -> _Object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotSafetensors(path, f"header is not JSON (not UTF-8: {exc.reason} at byte {exc.start})") from exc
    if exceeds_depth(text, MAX_JSON_DEPTH):
        raise NotSafetensors(path, f"header nests deeper than {MAX_JSON_DEPTH}")
    try:
        value = json.loads(text, object_pairs_hook=_Object, parse_int=_json_int, parse_float=_json_float,
                           parse_constant=_json_constant)
        _refuse_lone_surrogates(value, text)
    except RecursionError as exc:  # cannot happen after exceeds_depth; named all the same
        raise NotSafetensors(path, "header nests too deep") from exc
    except ValueError as exc:  # JSONDecodeError, _Refused
        raise NotSafetensors(path, f"header is not JSON the loader reads ({exc})") from exc
    if not isinstance(value, _Object):
        raise NotSafetensors(path, "header is not a JSON object")
    return value


def _json_int(literal: str) -> int | float:
    """A u64 stays an int (the only numbers a shape or offset may be); others are floats, as in serde."""
    if literal[0] != "-" and len(literal) <= 20 and int(literal) <= U64_MAX:
        return int(literal)
    return _json_float(literal)  # "-0", negatives and u64 overflow: never a usize


def _json_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused(f"number out of range: {literal[:32]}")
    return value


def _json_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _refuse_lone_surrogates(value: Any, text: str) -> None:
    """Python keeps an unpaired \\ud800 escape as a lone surrogate; serde_json refuses it."""
    if not _SURROGATE_ESCAPE.search(text):
        return  # no escape that could make one
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise _Refused("unpaired surrogate escape in a string") from exc
        elif isinstance(item, _Object):
            for key, v in item:
                stack.append(key)
                stack.append(v)
        elif isinstance(item, list):
            stack.extend(item)


# -- the header's structure, as serde derives it ----------------------------------------------


def _check_metadata(value: Any, path: object) -> None:
    if value is None:
        return
    if not isinstance(value, _Object) or any(not isinstance(v, str) for _, v in value):
        raise NotSafetensors(path, f"{METADATA_KEY} must be null or an object of strings")


def _tensor(name: str, value: Any, path: object) -> HeaderTensor:
    where = f"tensor {name[:64]!r}"
    if isinstance(value, _Object):
        fields: dict[str, Any] = {}
        for key, v in value:
            if key in TENSOR_FIELDS:
                if key in fields:
                    raise NotSafetensors(path, f"{where}: {key} appears twice")
                fields[key] = v
        missing = [f for f in TENSOR_FIELDS if f not in fields]
        if missing:
            raise NotSafetensors(path, f"{where}: missing {', '.join(missing)}")
        dtype, shape, offsets = (fields[f] for f in TENSOR_FIELDS)
    elif type(value) is list and len(value) == 3:
        dtype, shape, offsets = value
    else:
        raise NotSafetensors(path, f"{where}: not an object with dtype, shape and data_offsets")
    if type(shape) is not list or not all(_is_u64(d) for d in shape):
        raise NotSafetensors(path, f"{where}: shape must be a list of non-negative integers below 2**64")
    if type(offsets) is not list or len(offsets) != 2 or not all(_is_u64(o) for o in offsets):
        raise NotSafetensors(path, f"{where}: data_offsets must be two non-negative integers below 2**64")
    return HeaderTensor(name, _dtype(dtype, where, path), tuple(shape), offsets[0], offsets[1])


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value <= U64_MAX


def _dtype(value: Any, where: str, path: object) -> str:
    if isinstance(value, _Object) and len(value) == 1 and value[0][1] is None:
        value = value[0][0]  # serde's externally tagged spelling of a unit variant
    if not isinstance(value, str) or (value not in DTYPE_BYTES and value not in PARSED_ONLY_DTYPES):
        raise NotSafetensors(path, f"{where}: dtype {str(value)[:32]!r} is not a safetensors dtype")
    return value


def _check_tensor_bytes(t: HeaderTensor, offset: int, path: object) -> None:
    where = f"tensor {t.name[:64]!r}"
    if t.dtype not in DTYPE_BYTES:  # checked on the entries that count: a repeated name keeps the last
        raise NotSafetensors(path, f"{where}: dtype {t.dtype} is not one the torch loader reads "
                                   f"({', '.join(DTYPE_BYTES)})")
    if t.begin != offset or t.end < t.begin:
        raise NotSafetensors(path, f"{where}: data_offsets [{t.begin}, {t.end}] do not continue at {offset} "
                                   "(tensors must tile the data, in order, without gaps or overlaps)")
    elements = 1
    for dim in t.shape:
        elements *= dim
        if elements > U64_MAX:
            raise NotSafetensors(path, f"{where}: shape {list(t.shape)[:8]} overflows 64 bits")
    nbits = elements * 8 * DTYPE_BYTES[t.dtype]  # safetensors counts bits, in u64
    if nbits > U64_MAX:
        raise NotSafetensors(path, f"{where}: shape {list(t.shape)[:8]} overflows 64 bits")
    nbytes = nbits // 8
    if t.end - t.begin != nbytes:
        raise NotSafetensors(path, f"{where}: {t.end - t.begin} bytes for {elements} {t.dtype} elements "
                                   f"({nbytes} bytes)")
    if nbytes == 0:
        _check_empty_shape(t, where, path)


def _check_empty_shape(t: HeaderTensor, where: str, path: object) -> None:
    """torch.empty(shape): sizes and contiguous strides must fit in int64."""
    if any(dim > I64_MAX for dim in t.shape):
        raise NotSafetensors(path, f"{where}: a dimension exceeds 2**63 - 1")
    stride = 1
    for dim in reversed(t.shape[1:]):
        stride *= max(dim, 1)
        if stride > I64_MAX:
            raise NotSafetensors(path, f"{where}: shape {list(t.shape)[:8]} has a stride beyond 2**63 - 1")
