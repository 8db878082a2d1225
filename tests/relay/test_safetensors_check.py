"""The publish-time safetensors check passes exactly the files safetensors.torch.load loads."""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save

from benchmarks.fuzz_parsers import safetensors_inputs, torch_loads
from relay.errors import NotSafetensors
from relay.manifest import build_manifest
from relay.safetensors_check import check_safetensors

torch.set_num_threads(1)
FUZZED = 10_000
T = '{"a":{"dtype":%s,"shape":[1],"data_offsets":[0,4]}}'


def file_of(header: str, data: bytes = b"") -> bytes:
    raw = header.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw + data


def checks(blob: bytes) -> bool:
    try:
        check_safetensors(blob)
    except NotSafetensors:
        return False
    return True


CASES = {  # the loader's corners, each read the same way by both
    "plain": file_of(T % '"F32"', b"\0" * 4),
    "array spelling": file_of('{"a":["F32",[2],[0,8]]}', b"\0" * 8),
    "array of four": file_of('{"a":["F32",[2],[0,8],1]}', b"\0" * 8),
    "enum as a map": file_of(T % '{"F32":null}', b"\0" * 4),
    "enum map with a value": file_of(T % '{"F32":1}', b"\0" * 4),
    "unknown field, nested": file_of('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":[[[1]]]}}', b"\0" * 4),
    "repeated field": file_of('{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "repeated tensor, last wins": file_of('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                                          '"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "repeated tensor, first unloadable": file_of('{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]},'
                                                 '"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "repeated tensor, first untyped": file_of('{"a":{"dtype":"F32","shape":[2]},'
                                              '"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "repeated metadata": file_of('{"__metadata__":{},"__metadata__":{}}'),
    "metadata null": file_of('{"__metadata__":null}'),
    "metadata number": file_of('{"__metadata__":{"k":1}}'),
    "F4 does not load": file_of('{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}', b"\0"),
    "U64": file_of('{"a":{"dtype":"U64","shape":[1],"data_offsets":[0,8]}}', b"\0" * 8),
    "float offset": file_of('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}}', b"\0" * 4),
    "-0 offset": file_of('{"a":{"dtype":"F32","shape":[1],"data_offsets":[-0,4]}}', b"\0" * 4),
    "1e400 anywhere": file_of(T.replace('"data_offsets"', '"x":1e400,"data_offsets"') % '"F32"', b"\0" * 4),
    "big integer anywhere": file_of(T.replace('"data_offsets"', '"x":%s,"data_offsets"' % ("1" + "0" * 40))
                                    % '"F32"', b"\0" * 4),
    "lone surrogate": file_of('{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "surrogate pair": file_of('{"\\ud83d\\ude00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "nested 127": file_of('{"a":' + "[" * 126 + "]" * 126 + "}"),
    "nested 127 in an ignored field": file_of(T.replace('"data_offsets"', '"x":%s,"data_offsets"' % (
        "[" * 125 + "]" * 125)) % '"F32"', b"\0" * 4),
    "nested 128 in an ignored field": file_of(T.replace('"data_offsets"', '"x":%s,"data_offsets"' % (
        "[" * 126 + "]" * 126)) % '"F32"', b"\0" * 4),
    "empty tensor, dim 2**63": file_of('{"a":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]}}'),
    "empty tensor, dim 2**63-1": file_of('{"a":{"dtype":"U8","shape":[0,9223372036854775807],"data_offsets":[0,0]}}'),
    "stride just fits": file_of('{"a":{"dtype":"U8","shape":[0,3074457345618258602,3],"data_offsets":[0,0]}}'),
    "stride overflows": file_of('{"a":{"dtype":"U8","shape":[0,3074457345618258603,3],"data_offsets":[0,0]}}'),
    "shape overflows u64": file_of('{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}'),
    "gap": file_of('{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"\0" * 2),
    "overlap": file_of('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                       '"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', b"\0" * 3),
    "out of order but tiling": file_of('{"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},'
                                       '"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b"\0" * 4),
    "trailing data": file_of(T % '"F32"', b"\0" * 5),
    "top-level array": file_of("[]"),
    "BOM": file_of("\ufeff{}"),
    "NaN": file_of(T.replace('"data_offsets"', '"x":NaN,"data_offsets"') % '"F32"', b"\0" * 4),
    "header length too big": struct.pack("<Q", 100_000_001) + b"{}",
    "empty": b"",
}


@pytest.mark.parametrize("name", CASES)
def test_the_check_agrees_with_the_loader_on_its_corners(name):
    assert checks(CASES[name]) == torch_loads(CASES[name])


def test_the_check_agrees_with_the_loader_on_fuzzed_files():
    rng = np.random.default_rng(2024)
    disagree, accepted = [], 0
    for blob in safetensors_inputs(rng, FUZZED):
        ok = checks(blob)
        accepted += ok
        if ok != torch_loads(blob):
            disagree.append(blob[:300])
    assert not disagree, disagree[:3]
    assert FUZZED * 0.05 < accepted < FUZZED * 0.9  # the fuzzer reaches both answers


def test_a_saved_file_is_indexed_like_its_tensors(tmp_path):
    tensors = {"b": torch.zeros(3, 2, dtype=torch.bfloat16), "a": torch.arange(5), "e": torch.zeros(0, 7)}
    blob = save(tensors, metadata={"format": "pt"})
    assert {t.name: (t.dtype, t.shape) for t in check_safetensors(blob)} == {
        "a": ("I64", (5,)), "b": ("BF16", (3, 2)), "e": ("F32", (0, 7))}


def test_publishing_a_deeply_nested_header_is_a_named_error(tmp_path):
    path = tmp_path / "deep.safetensors"
    header = json.dumps({"__metadata__": {}})[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path.write_bytes(file_of(header))
    with pytest.raises(NotSafetensors, match="nests deeper"):
        build_manifest([path], model="m", version=0, now_ms=0)
