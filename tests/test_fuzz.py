"""Fuzzing headers and indexes: every outcome is the exact data or a SurgeryError, nothing else.

A seeded mutation loop (reproducible in CI) over a real safetensors file and a real sharded
index: byte flips, truncations and insertions in the header, and structural edits of its JSON
(dtypes, shapes, offsets, types, nesting). Whenever surgery opens a mutated file and reads it,
the safetensors package must read the same tensors from it; whenever it cannot, the error is a
:class:`~surgery.SurgeryError`.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import surgery
from surgery.checkpoint import open_checkpoint, write_checkpoint

SEED = 20261203
CASES = 300


def _source(path: Path) -> bytes:
    torch.manual_seed(0)
    write_checkpoint(
        {
            "a": torch.randn(3, 4),
            "b": torch.arange(6, dtype=torch.int32),
            "c": torch.randn(2).to(torch.bfloat16),
        },
        path,
    )
    return (path / "model.safetensors").read_bytes()


def _split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header: Any, data: bytes) -> bytes:
    text = json.dumps(header)
    for depth in (10, 2000, 100_000):  # nesting too deep for json.dumps itself: spliced in as text
        text = text.replace(f'"__nested_{depth}__"', "[" * depth + "0" + "]" * depth)
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + data


_VALUES: list[Any] = [
    0,
    1,
    -1,
    3,
    2**31,
    2**63,
    2**64,
    -(2**63),
    1.5,
    "F32",
    "F16",
    "BF16",
    "I64",
    "U8",
    "BOOL",
    "F8_E4M3",
    "F4",
    "X9",
    "",
    None,
    True,
    [],
    [0],
    [2, 3],
    [0, 2**63],
    [0, 2**62, 2**62],
    [-1, 4],
    {},
    {"x": 1},
    [[1]],
]


def _mutate_json(rng: random.Random, header: dict[str, Any]) -> Any:
    header = json.loads(json.dumps(header))
    kind = rng.randrange(6)
    keys = [k for k in header if k != "__metadata__"]
    key = rng.choice(keys)
    if kind == 0:
        header[key][rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(_VALUES)
    elif kind == 1:
        begin, end = header[key]["data_offsets"]
        header[key]["data_offsets"] = [begin + rng.randint(-8, 8), end + rng.randint(-8, 8)]
    elif kind == 2:
        del header[key][rng.choice(["dtype", "shape", "data_offsets"])]
    elif kind == 3:
        header["__metadata__"] = rng.choice(
            [{"k": 1}, [], "x", {"format": "pt", "n": "1"}, {"a": {"b": "c"}}]
        )
    elif kind == 4:
        header[rng.choice(["z", key + "x", ""])] = dict(header[key])  # a copy that overlaps
    else:
        header[key]["shape"] = f"__nested_{rng.choice([10, 2000, 100_000])}__"
    return header


def _mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    data = bytearray(raw)
    kind = rng.randrange(4)
    (n,) = struct.unpack("<Q", raw[:8])
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(8 + n)
            data[i] = rng.randrange(256)
    elif kind == 1:
        del data[rng.randrange(len(data)) :]
    elif kind == 2:
        i = rng.randrange(8, 8 + n)
        data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    else:
        data[:8] = struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, len(raw), 2**40, 2**64 - 1]))
    return bytes(data)


def _check(path: Path) -> str:
    """Open and read ``path``; compare with safetensors. Returns the outcome's kind."""
    try:
        with open_checkpoint(path) as reader:
            ours = {k: reader.get_tensor(k) for k in reader}
    except surgery.SurgeryError:
        return "refused"
    with safe_open(path, "pt") as f:  # surgery read it: safetensors must read the same
        theirs = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    assert sorted(ours) == sorted(theirs)
    for k, v in ours.items():
        assert v.dtype == theirs[k].dtype and v.shape == theirs[k].shape
        assert torch.equal(
            v.view(torch.uint8) if v.numel() else v, theirs[k].view(torch.uint8) if v.numel() else theirs[k]
        )
    return "read"


def test_mutated_headers_are_read_exactly_or_refused_with_a_surgery_error(tmp_path: Path) -> None:
    raw = _source(tmp_path / "src")
    header, data = _split(raw)
    rng = random.Random(SEED)
    outcomes: dict[str, int] = {}
    for case in range(CASES):
        mutated = _join(_mutate_json(rng, header), data) if case % 2 else _mutate_bytes(rng, raw)
        path = tmp_path / f"case{case}.safetensors"
        path.write_bytes(mutated)
        try:
            kind = _check(path)
        except AssertionError:
            raise
        except Exception as exc:  # anything but a SurgeryError is a bug
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        outcomes[kind] = outcomes.get(kind, 0) + 1
        path.unlink()
    assert outcomes.get("refused", 0) > CASES // 2  # the mutations mostly break the file ...
    assert outcomes.get("read", 0) > 0  # ... and some leave a valid one, read exactly


def _mutate_index(rng: random.Random, index: dict[str, Any]) -> Any:
    index = json.loads(json.dumps(index))
    weight_map = index["weight_map"]
    key = rng.choice(sorted(weight_map))
    kind = rng.randrange(6)
    if kind == 0:
        weight_map[key] = rng.choice(
            [
                "../x.safetensors",
                "/etc/passwd",
                "",
                ".",
                "a/../../b.safetensors",
                5,
                None,
                ["m"],
                "nope.safetensors",
            ]
        )
    elif kind == 1:
        del weight_map[key]
    elif kind == 2:
        weight_map[key + "x"] = weight_map[key]
    elif kind == 3:
        index[rng.choice(["weight_map", "metadata"])] = rng.choice([[], "x", 1, None, {"a": []}])
    elif kind == 4:
        index = rng.choice([[], "x", None, 3])
    else:
        weight_map[key] = (
            "model-00001-of-00002.safetensors"
            if weight_map[key].startswith("model-00002")
            else weight_map[key].replace("00001", "00002")
        )
    return index


def test_mutated_indexes_are_read_exactly_or_refused_with_a_surgery_error(tmp_path: Path) -> None:
    src = tmp_path / "src"
    sd = {f"t{i}": torch.full((8,), float(i)) for i in range(6)}
    write_checkpoint(sd, src, max_shard_size=70)
    index_path = src / "model.safetensors.index.json"
    original = json.loads(index_path.read_text())
    rng = random.Random(SEED)
    refused = 0
    for case in range(100):
        index_path.write_text(json.dumps(_mutate_index(rng, original)))
        try:
            with open_checkpoint(src) as reader:
                got = {k: reader.get_tensor(k) for k in reader}
        except surgery.SurgeryError:
            refused += 1
            continue
        except Exception as exc:
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd), case
    assert refused > 50
