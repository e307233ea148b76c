"""Checkpoint I/O: our safetensors reader/writer against safetensors itself, bad inputs, atomic saves."""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
import threading
import weakref
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from surgery.checkpoint import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    CheckpointReader,
    open_checkpoint,
    parse_size,
    write_checkpoint,
)
from surgery.errors import CheckpointError, SurgeryError

DTYPE_NAMES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "uint16",
    "uint32",
    "uint64",
    "complex64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
]
DTYPES = [getattr(torch, name) for name in DTYPE_NAMES if hasattr(torch, name)]
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype (booleans stay 0/1)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_identical(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert torch.equal(bits(actual), bits(expected))


def small_state_dict() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": random_tensor(torch.float32, (8, 4), 1),
        "layers.0.attn.weight": random_tensor(torch.bfloat16, (4, 4), 2),
        "layers.0.norm.weight": random_tensor(torch.float16, (4,), 3),
        "layers.1.attn.weight": random_tensor(torch.bfloat16, (4, 4), 4),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def load_all_with_safetensors(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for f in reader.files:
        merged.update(load_file(f))
    return merged


def write_raw(path: Path, header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> Path:
    """A hand-made safetensors file (for corrupt-file cases)."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
    return path


def listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


# ------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_written_file_is_bit_identical_under_safetensors_and_our_reader(tmp_path: Path, dtype) -> None:
    tensor = random_tensor(dtype, (3, 4))
    write_checkpoint({"t": tensor}, tmp_path / "x.safetensors")
    assert_identical(load_file(tmp_path / "x.safetensors")["t"], tensor)
    with open_checkpoint(tmp_path / "x.safetensors") as reader:
        assert_identical(reader.get_tensor("t"), tensor)
        assert_identical(reader.get_tensor("t", copy=False), tensor)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_reader_is_bit_identical_to_safetensors_on_files_safetensors_wrote(tmp_path: Path, dtype) -> None:
    tensors = {"a": random_tensor(dtype, (5, 2), 1), "b": random_tensor(dtype, (2,), 2)}
    save_file(tensors, tmp_path / "x.safetensors")
    expected = load_file(tmp_path / "x.safetensors")
    with open_checkpoint(tmp_path / "x.safetensors") as reader:
        for key, value in expected.items():
            assert_identical(reader.get_tensor(key), value)
            assert_identical(reader.read_into(key, torch.empty(value.shape, dtype=dtype)), value)


def test_empty_and_zero_dim_tensors_round_trip(tmp_path: Path) -> None:
    tensors = {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "empty_int": torch.empty(2, 0, dtype=torch.int32),
        "flag": torch.tensor(True),
    }
    write_checkpoint(tensors, tmp_path)
    reference = load_file(tmp_path / SAFE_WEIGHTS_NAME)
    with open_checkpoint(tmp_path) as reader:
        for key, value in tensors.items():
            assert_identical(reference[key], value)
            assert_identical(reader.get_tensor(key), value)
            assert_identical(reader.get_tensor(key, copy=False), value)
            assert_identical(reader.read_into(key, torch.empty(value.shape, dtype=value.dtype)), value)


def test_empty_state_dict_writes_a_loadable_file(tmp_path: Path) -> None:
    write_checkpoint({}, tmp_path)
    assert load_file(tmp_path / SAFE_WEIGHTS_NAME) == {}
    with open_checkpoint(tmp_path) as reader:
        assert reader.keys() == [] and len(reader) == 0


def test_directory_save_that_fits_writes_one_model_safetensors_without_index(tmp_path: Path) -> None:
    written = write_checkpoint(small_state_dict(), tmp_path)
    assert written == [tmp_path / SAFE_WEIGHTS_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == [SAFE_WEIGHTS_NAME]


def test_sharded_save_writes_numbered_shards_and_an_index_with_total_size(tmp_path: Path) -> None:
    sd = small_state_dict()
    written = write_checkpoint(sd, tmp_path, max_shard_size=80)
    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert written == [tmp_path / n for n in shards] + [tmp_path / SAFE_WEIGHTS_INDEX_NAME]
    assert len(shards) > 1 and all(n.endswith(f"-of-{len(shards):05d}.safetensors") for n in shards)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in sd.values())
    assert list(index["weight_map"]) == sorted(sd)
    assert set(index["weight_map"].values()) == set(shards)


def test_sharded_checkpoint_round_trips_bit_identically(tmp_path: Path) -> None:
    sd = small_state_dict()
    write_checkpoint(sd, tmp_path, max_shard_size=80)
    with open_checkpoint(tmp_path) as reader:
        assert reader.index == tmp_path / SAFE_WEIGHTS_INDEX_NAME
        reference = load_all_with_safetensors(reader)
        assert set(reader.keys()) == set(sd) == set(reference)
        for key, value in sd.items():
            assert_identical(reader.get_tensor(key), value)
            assert_identical(reference[key], value)


def test_tensor_larger_than_max_shard_size_gets_its_own_shard(tmp_path: Path) -> None:
    sd = {"small": torch.zeros(2), "big": torch.zeros(100), "tail": torch.zeros(2)}
    write_checkpoint(sd, tmp_path, max_shard_size=64)
    weight_map = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())["weight_map"]
    assert len(set(weight_map.values())) == 3
    assert weight_map["big"] not in {weight_map["small"], weight_map["tail"]}


def test_single_file_path_is_never_sharded(tmp_path: Path) -> None:
    written = write_checkpoint(small_state_dict(), tmp_path / "one.safetensors", max_shard_size=8)
    assert written == [tmp_path / "one.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.safetensors"]


def test_keys_follow_shard_order_then_data_offset_order(tmp_path: Path) -> None:
    write_checkpoint(small_state_dict(), tmp_path, max_shard_size=80)
    with open_checkpoint(tmp_path) as reader:
        positions = [(reader.files.index(reader.info(k).file), reader.info(k).offset) for k in reader]
    assert positions == sorted(positions)


def test_open_accepts_a_directory_its_index_or_one_file(tmp_path: Path) -> None:
    sd = small_state_dict()
    write_checkpoint(sd, tmp_path / "sharded", max_shard_size=80)
    write_checkpoint(sd, tmp_path / "single")
    for path in (tmp_path / "sharded", tmp_path / "sharded" / SAFE_WEIGHTS_INDEX_NAME, tmp_path / "single"):
        with open_checkpoint(path) as reader:
            assert reader.path == path
            assert set(reader.keys()) == set(sd)
    with open_checkpoint(tmp_path / "single" / SAFE_WEIGHTS_NAME) as reader:
        assert set(reader.keys()) == set(sd)


def test_model_safetensors_wins_over_an_index_in_the_same_directory(tmp_path: Path) -> None:
    write_checkpoint({"old": torch.zeros(40)}, tmp_path, max_shard_size=64)
    write_checkpoint({"new": torch.ones(1)}, tmp_path / SAFE_WEIGHTS_NAME)
    with open_checkpoint(tmp_path) as reader:
        assert reader.keys() == ["new"]


def test_metadata_holds_format_pt_caller_metadata_and_index_metadata(tmp_path: Path) -> None:
    write_checkpoint(small_state_dict(), tmp_path, max_shard_size=80, metadata={"origin": "test"})
    for f in tmp_path.glob("model-*.safetensors"):
        with open_checkpoint(f) as reader:
            assert reader.metadata == {"format": "pt", "origin": "test"}
    with open_checkpoint(tmp_path) as reader:
        total = reader.index_metadata["total_size"]
        assert reader.metadata == {
            "format": "pt",
            "origin": "test",
            "total_size": str(total),
            "total_parameters": str(reader.index_metadata["total_parameters"]),
        }


def test_written_tensors_are_aligned_to_their_element_size(tmp_path: Path) -> None:
    sd = {"b": torch.zeros(3, dtype=torch.int8), "d": torch.zeros(3, dtype=torch.float64)}
    sd |= {"h": torch.zeros(3, dtype=torch.float16), "f": torch.zeros(1)}
    write_checkpoint(sd, tmp_path)
    with open_checkpoint(tmp_path) as reader:
        for key in sd:
            info = reader.info(key)
            assert info.offset % info.dtype.itemsize == 0
            view = reader.get_tensor(key, copy=False)
            assert view.data_ptr() % info.dtype.itemsize == 0


def test_non_contiguous_tensors_are_saved_as_their_values(tmp_path: Path) -> None:
    sd = {
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "strided": torch.arange(12.0).reshape(3, 4)[:, ::2],
        "expanded": torch.ones(1, 3).expand(2, 3),
    }
    write_checkpoint(sd, tmp_path)
    reference = load_file(tmp_path / SAFE_WEIGHTS_NAME)
    for key, value in sd.items():
        assert torch.equal(reference[key], value)


def test_disjoint_views_of_one_buffer_are_both_saved(tmp_path: Path) -> None:
    fused = torch.arange(12.0).reshape(4, 3)
    q, k = fused.split(2)
    write_checkpoint({"q": q, "k": k}, tmp_path)
    reference = load_file(tmp_path / SAFE_WEIGHTS_NAME)
    assert torch.equal(reference["q"], q) and torch.equal(reference["k"], k)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=6
    ),
    shard_size=st.integers(1, 200),
)
def test_any_state_dict_round_trips_through_any_shard_size(specs, shard_size: int) -> None:
    sd = {}
    for i, (dtype, shape) in enumerate(specs):
        if dtype == getattr(torch, "float4_e2m1fn_x2", None) and not shape:
            shape = [1]
        sd[f"t{i}"] = random_tensor(dtype, tuple(shape), i)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(sd, tmp, max_shard_size=shard_size)
        with open_checkpoint(tmp) as reader:
            reference = load_all_with_safetensors(reader)
            assert reader.keys() == list(reader)
            assert set(reader.keys()) == set(sd)
            for key, value in sd.items():
                assert_identical(reference[key], value)
                assert_identical(reader.get_tensor(key), value)
                assert_identical(reader.get_tensor(key, copy=False), value)


# ------------------------------------------------------------------------------------------ reader API


def test_info_describes_where_the_bytes_are_without_reading_them(tmp_path: Path) -> None:
    tensor = random_tensor(torch.bfloat16, (3, 5))
    write_checkpoint({"a": torch.zeros(7), "t": tensor}, tmp_path)
    with open_checkpoint(tmp_path) as reader:
        info = reader.info("t")
    assert (info.key, info.dtype, info.shape, info.nbytes, info.numel) == (
        "t",
        torch.bfloat16,
        (3, 5),
        30,
        15,
    )
    assert info.file == tmp_path / SAFE_WEIGHTS_NAME
    raw = info.file.read_bytes()[info.offset : info.offset + info.nbytes]
    assert raw == bytes(bits(tensor).tolist())


def test_missing_key_error_names_the_key_and_close_matches(tmp_path: Path) -> None:
    write_checkpoint(small_state_dict(), tmp_path)
    with open_checkpoint(tmp_path) as reader, pytest.raises(CheckpointError) as err:
        reader.get_tensor("layers.0.atn.weight")
    assert "'layers.0.atn.weight'" in str(err.value)
    assert "layers.0.attn.weight" in str(err.value)


def test_contains_and_len_reflect_the_stored_keys(tmp_path: Path) -> None:
    write_checkpoint(small_state_dict(), tmp_path, max_shard_size=80)
    with open_checkpoint(tmp_path) as reader:
        assert "step" in reader and "nope" not in reader and 3 not in reader
        assert len(reader) == len(small_state_dict())


@pytest.mark.parametrize(
    ("shape", "dim", "start", "stop"),
    [((6, 4), 0, 1, 4), ((6, 4), 1, 1, 3), ((6, 4), -1, 0, 2), ((2, 3, 4), 1, 1, 3), ((1, 5, 3), 1, 2, 5)],
    ids=["rows", "columns", "negative-dim", "middle-dim", "leading-size-1"],
)
def test_get_slice_equals_slicing_the_full_tensor(tmp_path: Path, shape, dim, start, stop) -> None:
    tensor = random_tensor(torch.float32, shape)
    write_checkpoint({"t": tensor}, tmp_path)
    expected = tensor.narrow(dim, start, stop - start)
    with open_checkpoint(tmp_path) as reader:
        part = reader.get_slice("t", dim, start, stop)
        view = reader.get_slice("t", dim, start, stop, copy=False)
    assert part.is_contiguous()
    assert_identical(part, expected)
    assert torch.equal(view, expected)


def test_get_slice_rows_shares_memory_with_the_mapping_when_not_copied(tmp_path: Path) -> None:
    write_checkpoint({"t": torch.arange(12.0).reshape(4, 3)}, tmp_path)
    with open_checkpoint(tmp_path) as reader:
        whole = reader.get_tensor("t", copy=False)
        rows = reader.get_slice("t", 0, 1, 3, copy=False)
        assert rows.data_ptr() == whole[1].data_ptr()


@pytest.mark.parametrize(
    ("key", "dim", "start", "stop"),
    [("t", 0, 2, 9), ("t", 2, 0, 1), ("t", 0, 3, 1), ("t", 0, -1, 2), ("scalar", 0, 0, 1)],
    ids=["stop-too-large", "no-such-dim", "start-after-stop", "negative-start", "zero-dim"],
)
def test_get_slice_rejects_bad_bounds_naming_key_and_shape(tmp_path: Path, key, dim, start, stop) -> None:
    write_checkpoint({"t": torch.zeros(4, 3), "scalar": torch.tensor(1.0)}, tmp_path)
    with open_checkpoint(tmp_path) as reader, pytest.raises(CheckpointError, match=repr(key)):
        reader.get_slice(key, dim, start, stop)


def test_read_into_fills_the_given_tensor_in_place(tmp_path: Path) -> None:
    tensor = random_tensor(torch.float16, (4, 4))
    write_checkpoint({"t": tensor}, tmp_path)
    out = torch.empty(4, 4, dtype=torch.float16)
    with open_checkpoint(tmp_path) as reader:
        result = reader.read_into("t", out)
    assert result is out
    assert_identical(out, tensor)


@pytest.mark.parametrize(
    ("out", "problem"),
    [
        (torch.empty(4, 4, dtype=torch.float32), "dtype"),
        (torch.empty(4, 5, dtype=torch.float16), "shape"),
        (torch.empty(4, 4, dtype=torch.float16, device="meta"), "meta"),
    ],
    ids=["dtype", "shape", "meta-device"],
)
def test_read_into_rejects_a_mismatched_destination(tmp_path: Path, out: torch.Tensor, problem: str) -> None:
    write_checkpoint({"t": torch.zeros(4, 4, dtype=torch.float16)}, tmp_path)
    with open_checkpoint(tmp_path) as reader, pytest.raises(CheckpointError, match=problem) as err:
        reader.read_into("t", out)
    assert "'t'" in str(err.value)


def test_read_into_a_strided_destination_fills_it_by_value(tmp_path: Path) -> None:
    tensor = random_tensor(torch.float32, (3, 5))
    write_checkpoint({"t": tensor}, tmp_path)
    storage = torch.zeros(5, 3)
    with open_checkpoint(tmp_path) as reader:
        reader.read_into("t", storage.t())
    assert torch.equal(storage.t(), tensor)


def test_zero_copy_view_shares_the_mapping_and_writes_never_reach_the_file(tmp_path: Path) -> None:
    tensor = torch.arange(6.0)
    write_checkpoint({"t": tensor}, tmp_path)
    before = (tmp_path / SAFE_WEIGHTS_NAME).read_bytes()
    with open_checkpoint(tmp_path) as reader:
        first = reader.get_tensor("t", copy=False)
        second = reader.get_tensor("t", copy=False)
        assert first.data_ptr() == second.data_ptr()
        first.fill_(-1.0)
        assert torch.equal(second, torch.full((6,), -1.0))
        assert torch.equal(reader.get_tensor("t"), tensor)  # copies come from the file
    assert (tmp_path / SAFE_WEIGHTS_NAME).read_bytes() == before
    assert torch.equal(load_file(tmp_path / SAFE_WEIGHTS_NAME)["t"], tensor)


def test_owned_copies_do_not_share_memory_with_the_mapping(tmp_path: Path) -> None:
    write_checkpoint({"t": torch.arange(6.0)}, tmp_path)
    with open_checkpoint(tmp_path) as reader:
        view = reader.get_tensor("t", copy=False)
        copy = reader.get_tensor("t")
        copy.zero_()
        assert torch.equal(view, torch.arange(6.0))


def test_zero_copy_views_stay_valid_after_the_reader_closes(tmp_path: Path) -> None:
    write_checkpoint({"t": torch.arange(6.0)}, tmp_path)
    with open_checkpoint(tmp_path) as reader:
        view = reader.get_tensor("t", copy=False)
    assert torch.equal(view * 1, torch.arange(6.0))


def test_a_closed_reader_refuses_reads(tmp_path: Path) -> None:
    write_checkpoint({"t": torch.zeros(2)}, tmp_path)
    reader = open_checkpoint(tmp_path)
    reader.close()
    with pytest.raises(CheckpointError, match="closed"):
        reader.get_tensor("t")


def test_reading_one_key_reads_only_the_headers_and_that_key(tmp_path: Path) -> None:
    # A 1 GiB tensor that exists only as a hole in a sparse file: reading "small" must not touch it.
    big = 2**30
    header = {
        "small": {"dtype": "I32", "shape": [3], "data_offsets": [0, 12]},
        "big": {"dtype": "F32", "shape": [big // 4], "data_offsets": [12, 12 + big]},
    }
    path = write_raw(tmp_path / "sparse.safetensors", header, struct.pack("<3i", 5, 6, 7))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + big)
    with open_checkpoint(path) as reader:
        assert reader.info("big").nbytes == big
        assert reader.get_tensor("small").tolist() == [5, 6, 7]
        assert reader.get_slice("big", 0, 0, 2).tolist() == [0.0, 0.0]


def test_four_threads_reading_concurrently_get_identical_tensors(tmp_path: Path) -> None:
    sd = {f"layer.{i}.weight": random_tensor(torch.bfloat16, (64, 33), i) for i in range(16)}
    write_checkpoint(sd, tmp_path, max_shard_size=20_000)
    start = threading.Barrier(4)

    def work(worker: int) -> list[tuple[str, str, torch.Tensor]]:
        start.wait()
        got = []
        for round_ in range(5):
            for key in reader.keys()[worker::2] if round_ % 2 else reader.keys():
                got.append((key, "copy", reader.get_tensor(key)))
                got.append((key, "view", reader.get_tensor(key, copy=False).clone()))
                got.append((key, "into", reader.read_into(key, torch.empty(64, 33, dtype=torch.bfloat16))))
                got.append((key, "rows", reader.get_slice(key, 0, 8, 40)))
                got.append((key, "cols", reader.get_slice(key, 1, 3, 20)))
        return got

    with open_checkpoint(tmp_path) as reader, ThreadPoolExecutor(4) as pool:
        results = [r for chunk in pool.map(work, range(4)) for r in chunk]
    expected = {"copy": lambda t: t, "view": lambda t: t, "into": lambda t: t}
    expected |= {"rows": lambda t: t[8:40], "cols": lambda t: t[:, 3:20]}
    for key, how, tensor in results:
        assert_identical(tensor, expected[how](sd[key]))


# ------------------------------------------------------------------------------------------ corrupt files

ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _with(**changes) -> dict:
    return {"w": {**ENTRY, **changes}}


CORRUPT_FILES = {
    "shorter-than-8-bytes": (None, b"\x01\x02", "fewer than the 8-byte"),
    "header-length-beyond-file": (1000, {"w": ENTRY}, "the header claims 1000 bytes"),
    "bad-json": (None, b'{"w": {"dtype": ', "not valid JSON"),
    "header-not-an-object": (None, b"[1, 2]", "not a JSON object"),
    "duplicate-key": (None, b'{"w": ' + json.dumps(ENTRY).encode() + b', "w": {}}', "duplicate key 'w'"),
    "shape-not-a-list": (None, _with(shape="2"), "'w' has shape"),
    "negative-shape": (None, _with(shape=[-2]), "'w' has shape"),
    "offsets-not-two-ints": (None, _with(data_offsets=[0]), "'w' has data_offsets"),
    "offsets-reversed": (None, _with(data_offsets=[8, 0]), "begin <= end"),
    "offsets-not-matching-dtype-x-shape": (None, _with(shape=[3]), "needs 12 bytes"),
    "offsets-past-end-of-file": (None, _with(shape=[4], data_offsets=[0, 16]), "ends at byte"),
    "overlapping-tensors": (
        None,
        {"w": ENTRY, "v": {"dtype": "I32", "shape": [1], "data_offsets": [4, 8]}},
        "overlap",
    ),
    "metadata-not-strings": (None, {"__metadata__": {"n": 1}, "w": ENTRY}, "__metadata__"),
}


@pytest.mark.parametrize(("length", "header", "problem"), CORRUPT_FILES.values(), ids=CORRUPT_FILES.keys())
def test_corrupt_file_is_rejected_naming_file_and_problem(tmp_path: Path, length, header, problem) -> None:
    path = tmp_path / "bad.safetensors"
    if header == b"\x01\x02":
        path.write_bytes(header)
    else:
        write_raw(path, header, bytes(8), length=length)
    with pytest.raises(CheckpointError, match="re-download") as err:
        open_checkpoint(path)
    assert str(path) in str(err.value)
    assert problem in str(err.value)


@pytest.mark.parametrize("dtype", ["F7", "F6_E2M3"], ids=["not-a-dtype", "no-torch-dtype"])
def test_unknown_dtype_error_names_file_key_and_supported_dtypes(tmp_path: Path, dtype: str) -> None:
    path = write_raw(tmp_path / "bad.safetensors", _with(dtype=dtype), bytes(8))
    with pytest.raises(CheckpointError, match="Supported dtypes: F64, F32") as err:
        open_checkpoint(path)
    assert f"'w' in '{path}' has dtype '{dtype}'" in str(err.value)


def test_a_directory_without_a_checkpoint_says_what_it_found(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors.*config\.json"):
        open_checkpoint(tmp_path)


def test_a_missing_path_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nope.safetensors")


# ------------------------------------------------------------------------------------------ bad indexes


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    write_checkpoint(
        {"a": torch.zeros(8), "b": torch.ones(8), "c": torch.full((8,), 2.0)}, directory, max_shard_size=40
    )
    return directory


def edit_index(directory: Path, edit) -> None:
    path = directory / SAFE_WEIGHTS_INDEX_NAME
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))


def test_index_naming_a_missing_shard_file_is_rejected(sharded: Path) -> None:
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors.*does not exist") as err:
        open_checkpoint(sharded)
    assert "'b'" in str(err.value)


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "sub/../../outside.safetensors", "/tmp/outside.safetensors"]
)
def test_index_shard_path_escaping_the_directory_is_rejected(sharded: Path, shard: str) -> None:
    write_checkpoint({"a": torch.zeros(8)}, sharded.parent / "outside.safetensors")
    edit_index(sharded, lambda index: index["weight_map"].update(a=shard))
    with pytest.raises(CheckpointError, match="escapes the checkpoint directory") as err:
        open_checkpoint(sharded)
    assert "'a'" in str(err.value)


def test_index_shard_symlinked_outside_the_directory_is_rejected(sharded: Path) -> None:
    outside = sharded.parent / "outside.safetensors"
    write_checkpoint({"a": torch.zeros(8)}, outside)
    (sharded / "link.safetensors").symlink_to(outside)
    edit_index(sharded, lambda index: index["weight_map"].update(a="link.safetensors"))
    with pytest.raises(CheckpointError, match=r"symlink .* outside the checkpoint directory"):
        open_checkpoint(sharded)


def test_index_shard_symlinked_inside_the_directory_is_accepted(sharded: Path) -> None:
    (sharded / "model-00001-of-00003.safetensors").rename(sharded / "real.safetensors")
    (sharded / "alias.safetensors").symlink_to("real.safetensors")
    edit_index(sharded, lambda index: index["weight_map"].update(a="alias.safetensors"))
    with open_checkpoint(sharded) as reader:
        assert torch.equal(reader.get_tensor("a"), torch.zeros(8))


def test_index_key_absent_from_its_shard_is_rejected(sharded: Path) -> None:
    edit_index(sharded, lambda index: index["weight_map"].update(ghost="model-00001-of-00003.safetensors"))
    with pytest.raises(CheckpointError, match=r"not in it, e\.g\. \['ghost'\]") as err:
        open_checkpoint(sharded)
    assert SAFE_WEIGHTS_INDEX_NAME in str(err.value)


def test_shard_key_missing_from_the_index_is_reported_not_dropped(tmp_path: Path) -> None:
    write_checkpoint(
        {"a": torch.zeros(8), "b": torch.ones(8), "c": torch.ones(8)}, tmp_path, max_shard_size=64
    )
    edit_index(tmp_path, lambda index: index["weight_map"].pop("b"))
    with pytest.raises(CheckpointError, match=r"does not map to it, e\.g\. \['b'\]"):
        open_checkpoint(tmp_path)


def test_shard_of_the_series_that_the_index_never_names_is_reported(sharded: Path) -> None:
    edit_index(sharded, lambda index: index["weight_map"].pop("b"))
    with pytest.raises(
        CheckpointError, match=r"model-00002-of-00003\.safetensors' belongs to the same series"
    ):
        open_checkpoint(sharded)


def test_index_that_is_not_json_is_rejected(sharded: Path) -> None:
    (sharded / SAFE_WEIGHTS_INDEX_NAME).write_text("{oops")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        open_checkpoint(sharded)


def test_index_without_weight_map_is_rejected(sharded: Path) -> None:
    (sharded / SAFE_WEIGHTS_INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="no 'weight_map'"):
        open_checkpoint(sharded)


def test_corrupt_shard_behind_an_index_is_rejected_naming_the_shard(sharded: Path) -> None:
    shard = sharded / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match="ends at byte") as err:
        open_checkpoint(sharded)
    assert str(shard) in str(err.value)


# ------------------------------------------------------------------------------------------ pickle


def test_pickle_checkpoints_are_refused_by_default(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    for path in (tmp_path / "pytorch_model.bin", tmp_path):
        with pytest.raises(CheckpointError, match="allow_pickle=True"):
            open_checkpoint(path)


def test_pickle_checkpoint_loads_with_explicit_opt_in(tmp_path: Path) -> None:
    sd = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    torch.save(sd, tmp_path / "weights.pt")
    with open_checkpoint(tmp_path / "weights.pt", allow_pickle=True) as reader:
        assert reader.keys() == ["w", "b"]
        assert reader.info("w").offset == -1
        assert torch.equal(reader.get_tensor("w"), sd["w"])
        assert torch.equal(reader.get_slice("w", 1, 1, 3), sd["w"][:, 1:3])
        assert torch.equal(reader.read_into("b", torch.empty(3, dtype=torch.bfloat16)), sd["b"])


class _RunsCode:
    def __reduce__(self):
        return (print, ("this must never run",))


class _RunsOsCode:
    def __reduce__(self):
        return (os.getcwd, ())


@pytest.mark.parametrize(
    ("evil", "named"),
    [(_RunsCode(), "'print'"), (_RunsOsCode(), "getcwd'")],
    ids=["builtin", "blocked-module"],
)
def test_pickle_with_arbitrary_objects_is_refused_even_with_opt_in(
    tmp_path: Path, evil: object, named: str
) -> None:
    torch.save({"w": torch.ones(2), "evil": evil}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only=True") as caught:
        open_checkpoint(tmp_path, allow_pickle=True)
    message = str(caught.value)
    assert named in message  # what the file tried to smuggle in
    assert "False" not in message and "allowlist" not in message  # no advice to lift the check


def test_sharded_pickle_index_is_refused_by_default(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model-00001-of-00001.bin")
    index = {"metadata": {}, "weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="allow_pickle"):
        open_checkpoint(tmp_path)
    with open_checkpoint(tmp_path, allow_pickle=True) as reader:
        assert torch.equal(reader.get_tensor("w"), torch.ones(2))


# ------------------------------------------------------------------------------------------ writer validation


@pytest.mark.parametrize(
    ("state_dict", "problem"),
    [
        ({1: torch.zeros(1)}, "keys must be strings"),
        ({"__metadata__": torch.zeros(1)}, "keys must be strings"),
        ({"w": [1.0, 2.0]}, "expected a torch.Tensor"),
        ({"w": torch.zeros(2, 2).to_sparse()}, "to_dense"),
        ({"w": torch.zeros(2, device="meta")}, "meta device"),
        ({"w": torch.zeros(2, dtype=torch.complex128)}, "no safetensors equivalent"),
        (["w"], "expects a Mapping"),
    ],
    ids=["non-str-key", "reserved-key", "non-tensor", "sparse", "meta", "complex128", "not-a-mapping"],
)
def test_invalid_state_dict_is_rejected_before_any_byte_is_written(
    tmp_path: Path, state_dict, problem
) -> None:
    with pytest.raises(CheckpointError, match=problem):
        write_checkpoint(
            {"ok": torch.zeros(1), **state_dict} if isinstance(state_dict, dict) else state_dict,
            tmp_path / "c",
        )
    assert not (tmp_path / "c").exists()


def test_tied_tensors_are_refused_naming_both_keys(tmp_path: Path) -> None:
    weight = torch.zeros(4, 2)
    with pytest.raises(
        CheckpointError, match=r"'embed\.weight' and 'lm_head\.weight' share memory.*drop one"
    ):
        write_checkpoint({"lm_head.weight": weight, "embed.weight": weight}, tmp_path / "c")
    with pytest.raises(CheckpointError, match="share memory"):
        write_checkpoint({"a": weight, "b": weight[1:3]}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


class _RepeatsAKey(Mapping):
    def __iter__(self) -> Iterator[str]:
        return iter(["a", "a"])

    def __len__(self) -> int:
        return 2

    def __getitem__(self, key: str) -> torch.Tensor:
        return torch.zeros(1)


def test_a_key_repeated_by_the_mapping_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="'a' appears twice"):
        write_checkpoint(_RepeatsAKey(), tmp_path / "c")


@pytest.mark.parametrize(
    "metadata", [{"n": 1}, {2: "x"}, {"format": "tf"}], ids=["non-str-value", "non-str-key", "format"]
)
def test_bad_metadata_is_rejected(tmp_path: Path, metadata) -> None:
    with pytest.raises(CheckpointError):
        write_checkpoint({"w": torch.zeros(1)}, tmp_path / "c", metadata=metadata)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("size", "expected"),
    [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("1KB", 1000), ("1.5 KiB", 1536), ("10", 10), (123, 123)],
)
def test_parse_size_understands_decimal_and_binary_units(size, expected: int) -> None:
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["5 parsecs", "GB", "", "-1GB", 0, -5, 1.5, True, "0MB"])
def test_parse_size_rejects_junk_with_a_surgery_error(size) -> None:
    with pytest.raises(SurgeryError):
        parse_size(size)


# ------------------------------------------------------------------------------------------ atomic saves


class _FailsToSerialize(torch.Tensor):
    """Passes every check, then fails when its bytes are about to be written."""

    failure: type[BaseException] = RuntimeError

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            raise cls.failure("injected failure while serializing")
        return super().__torch_function__(func, types, args, kwargs or {})


class _InterruptedWhileSerializing(_FailsToSerialize):
    failure = KeyboardInterrupt


def _new_state_dict_failing_midway(failing: type[_FailsToSerialize]) -> dict[str, torch.Tensor]:
    sd = {f"new.{i}": torch.full((8,), float(i)) for i in range(6)}
    sd["new.4"] = torch.ones(8).as_subclass(failing)  # after several shards are already on disk
    return sd


@pytest.mark.parametrize(
    "failing", [_FailsToSerialize, _InterruptedWhileSerializing], ids=["exception", "keyboard-interrupt"]
)
def test_failed_save_leaves_the_previous_sharded_checkpoint_loadable(sharded: Path, failing) -> None:
    before = listing(sharded)
    with pytest.raises(failing.failure, match="injected"):
        write_checkpoint(_new_state_dict_failing_midway(failing), sharded, max_shard_size=40)
    assert listing(sharded) == before  # nothing replaced, no temporary file left behind
    with open_checkpoint(sharded) as reader:
        assert torch.equal(reader.get_tensor("c"), torch.full((8,), 2.0))


def test_failed_save_over_a_single_file_leaves_it_untouched(tmp_path: Path) -> None:
    write_checkpoint({"old": torch.ones(3)}, tmp_path / "m.safetensors")
    before = listing(tmp_path)
    with pytest.raises(RuntimeError, match="injected"):
        write_checkpoint(_new_state_dict_failing_midway(_FailsToSerialize), tmp_path / "m.safetensors")
    assert listing(tmp_path) == before


def test_failed_save_into_a_new_directory_leaves_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="injected"):
        write_checkpoint(
            _new_state_dict_failing_midway(_FailsToSerialize), tmp_path / "a" / "b", max_shard_size=40
        )
    assert list(tmp_path.iterdir()) == []


class _BreaksMidway(Mapping):
    """A state dict whose third lookup raises."""

    def __init__(self) -> None:
        self.lookups = 0

    def __iter__(self) -> Iterator[str]:
        return iter(f"k{i}" for i in range(5))

    def __len__(self) -> int:
        return 5

    def __getitem__(self, key: str) -> torch.Tensor:
        self.lookups += 1
        if self.lookups == 3:
            raise RuntimeError("injected lookup failure")
        return torch.zeros(8)


def test_state_dict_lookup_failing_midway_leaves_previous_checkpoint_untouched(sharded: Path) -> None:
    before = listing(sharded)
    with pytest.raises(RuntimeError, match="injected lookup failure"):
        write_checkpoint(_BreaksMidway(), sharded, max_shard_size=40)
    assert listing(sharded) == before


def test_failed_commit_rolls_back_every_renamed_file(tmp_path: Path) -> None:
    # A live single-file checkpoint, a leftover shard file, and a directory squatting on the index
    # name: the new shards get renamed into place, then the index rename fails.
    write_checkpoint({"live": torch.ones(4)}, tmp_path)
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"leftover")
    (tmp_path / SAFE_WEIGHTS_INDEX_NAME).mkdir()
    (tmp_path / SAFE_WEIGHTS_INDEX_NAME / "blocker").write_text("x")
    before = listing(tmp_path)
    with pytest.raises(CheckpointError, match=r"previous checkpoint there .* is unchanged"):
        write_checkpoint({"a": torch.zeros(8), "b": torch.zeros(8)}, tmp_path, max_shard_size=40)
    assert listing(tmp_path) == before
    with open_checkpoint(tmp_path) as reader:
        assert reader.keys() == ["live"]


def test_stale_shards_are_removed_when_the_shard_count_shrinks(sharded: Path) -> None:
    (sharded / "README.md").write_text("keep me")
    write_checkpoint({"x": torch.zeros(8), "y": torch.ones(8)}, sharded, max_shard_size=40)
    assert sorted(p.name for p in sharded.iterdir()) == [
        "README.md",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        SAFE_WEIGHTS_INDEX_NAME,
    ]
    with open_checkpoint(sharded) as reader:
        assert reader.keys() == ["x", "y"]


def test_resaving_a_sharded_checkpoint_as_one_file_removes_index_and_shards(sharded: Path) -> None:
    write_checkpoint({"x": torch.zeros(2)}, sharded)
    assert sorted(p.name for p in sharded.iterdir()) == [SAFE_WEIGHTS_NAME]


def test_resaving_a_single_file_checkpoint_as_shards_removes_the_single_file(tmp_path: Path) -> None:
    write_checkpoint({"x": torch.zeros(2)}, tmp_path)
    write_checkpoint({"a": torch.zeros(8), "b": torch.zeros(8)}, tmp_path, max_shard_size=40)
    assert SAFE_WEIGHTS_NAME not in os.listdir(tmp_path)
    with open_checkpoint(tmp_path) as reader:
        assert reader.keys() == ["a", "b"]


def test_resaving_tensors_read_zero_copy_from_the_same_checkpoint_works(sharded: Path) -> None:
    with open_checkpoint(sharded) as reader:
        views = {k: reader.get_tensor(k, copy=False) for k in reader}
        write_checkpoint({f"renamed.{k}": v for k, v in views.items()}, sharded, max_shard_size=40)
    with open_checkpoint(sharded) as reader:
        assert torch.equal(reader.get_tensor("renamed.c"), torch.full((8,), 2.0))


# ------------------------------------------------------------------------------------------ streaming writes (specs)


def specs_of(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()}


class _Lazy(Mapping):
    """Computes a fresh tensor on every lookup (as a converter would), and tracks which are alive."""

    def __init__(self, values: Mapping[str, torch.Tensor], *, fail_at: str | None = None) -> None:
        self._values = dict(values)
        self._fail_at = fail_at
        self.lookups: list[str] = []
        self._refs: list[weakref.ref] = []
        self.most_alive = 0

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, key: str) -> torch.Tensor:
        self.lookups.append(key)
        if key == self._fail_at:
            raise RuntimeError(f"injected failure computing {key}")
        value = self._values[key].clone()
        self._refs.append(weakref.ref(value))
        self.most_alive = max(self.most_alive, sum(r() is not None for r in self._refs))
        return value


def mixed_state_dict() -> dict[str, torch.Tensor]:
    """Keys whose order differs from the header's (largest elements first, then by key)."""
    sd = {"z.bias": random_tensor(torch.float16, (6,), 7), **small_state_dict()}
    sd["t.weight"] = random_tensor(torch.float32, (3, 5), 8).t()  # not contiguous
    sd["empty"] = torch.zeros(0, 4, dtype=torch.float64)
    return sd


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=6
    ),
    shard_size=st.integers(1, 200),
    single_file=st.booleans(),
)
def test_specs_write_is_byte_identical_to_writing_the_tensors(
    specs, shard_size: int, single_file: bool
) -> None:
    sd = {}
    for i, (dtype, shape) in enumerate(specs):
        if dtype == getattr(torch, "float4_e2m1fn_x2", None) and not shape:
            shape = [1]
        sd[f"t{(7 * i) % 11}"] = random_tensor(dtype, tuple(shape), i)
    name = "m.safetensors" if single_file else ""
    with tempfile.TemporaryDirectory() as plain, tempfile.TemporaryDirectory() as lazy:
        write_checkpoint(sd, Path(plain) / name, max_shard_size=shard_size)
        write_checkpoint(_Lazy(sd), Path(lazy) / name, max_shard_size=shard_size, specs=specs_of(sd))
        assert listing(Path(lazy)) == listing(Path(plain))


def test_specs_write_looks_up_each_value_once_in_specs_order(tmp_path: Path) -> None:
    sd = mixed_state_dict()
    order = sorted(sd, reverse=True)
    lazy = _Lazy(sd)
    write_checkpoint(lazy, tmp_path, max_shard_size=100, specs={k: specs_of(sd)[k] for k in order})
    assert lazy.lookups == order
    with open_checkpoint(tmp_path) as reader:
        assert len(reader.files) > 1
        for key, value in sd.items():
            assert_identical(reader.get_tensor(key), value)


def test_specs_write_holds_at_most_one_value_at_a_time(tmp_path: Path) -> None:
    sd = mixed_state_dict()
    lazy = _Lazy(sd)
    write_checkpoint(lazy, tmp_path, max_shard_size=100, specs=specs_of(sd))
    assert len(lazy.lookups) == len(sd)
    assert lazy.most_alive == 1
    lazy = _Lazy(sd)
    write_checkpoint(lazy, tmp_path / "m.safetensors", specs=specs_of(sd))
    assert lazy.most_alive == 1


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (torch.zeros(3, 4), r"shape \(3, 4\) and dtype torch.float32, but specs promised shape \(4, 4\)"),
        (torch.zeros(4, 4, dtype=torch.float16), r"dtype torch.float16, but specs promised .* torch.float32"),
        (torch.zeros(4, 4, device="meta"), "meta device"),
        (torch.zeros(4, 4).to_sparse(), "to_dense"),
        ([0.0] * 16, "expected a torch.Tensor"),
    ],
    ids=["shape", "dtype", "meta", "sparse", "not-a-tensor"],
)
def test_value_that_does_not_match_its_spec_is_refused_and_the_previous_checkpoint_stays(
    sharded: Path, value, problem: str
) -> None:
    before = listing(sharded)
    sd = {"first": torch.ones(8), "bad.key": value, "last": torch.ones(8)}
    specs = {
        "first": ((8,), torch.float32),
        "bad.key": ((4, 4), torch.float32),
        "last": ((8,), torch.float32),
    }
    with pytest.raises(CheckpointError, match=rf"Cannot save 'bad\.key': .*{problem}"):
        write_checkpoint(sd, sharded, max_shard_size=40, specs=specs)
    assert listing(sharded) == before
    with open_checkpoint(sharded) as reader:
        assert torch.equal(reader.get_tensor("c"), torch.full((8,), 2.0))


@pytest.mark.parametrize(
    ("specs", "problem"),
    [
        ({"a": ((2,), torch.float32)}, r"no spec for \['b'\]"),
        (
            {"a": ((2,), torch.float32), "b": ((2,), torch.float32), "c": ((2,), torch.float32)},
            r"no value for \['c'\]",
        ),
        ({"a": ((2,), torch.float32), "b": (2, torch.float32)}, r"specs\['b'\] is \(2, torch.float32\)"),
        ({"a": ((2,), torch.float32), "b": ((-2,), torch.float32)}, r"specs\['b'\]"),
        ({"a": ((2,), torch.float32), "b": ((2,), "float32")}, r"specs\['b'\]"),
        ({"a": ((2,), torch.float32), "b": ((2,), torch.complex128)}, "no safetensors equivalent"),
        ({"a": ((2,), torch.float32), 3: ((2,), torch.float32)}, "keys must be strings"),
        ([("a", ((2,), torch.float32))], "expects a Mapping"),
    ],
    ids=[
        "missing-spec",
        "extra-spec",
        "not-a-pair",
        "negative-dim",
        "not-a-dtype",
        "complex128",
        "non-str",
        "list",
    ],
)
def test_bad_specs_are_refused_before_any_value_is_looked_up(tmp_path: Path, specs, problem: str) -> None:
    lazy = _Lazy({"a": torch.zeros(2), "b": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=problem):
        write_checkpoint(lazy, tmp_path / "c", specs=specs)
    assert lazy.lookups == []
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("fail_at", "failing", "raised"),
    [
        ("new.4", None, RuntimeError),
        (None, _FailsToSerialize, RuntimeError),
        (None, _InterruptedWhileSerializing, KeyboardInterrupt),
    ],
    ids=["lookup-raises", "write-raises", "keyboard-interrupt"],
)
def test_specs_write_failing_midway_leaves_the_previous_checkpoint_loadable(
    sharded: Path, fail_at, failing, raised
) -> None:
    before = listing(sharded)
    sd = _new_state_dict_failing_midway(failing or _FailsToSerialize)
    if failing is None:
        sd["new.4"] = torch.ones(8)
    lazy = _Lazy(sd, fail_at=fail_at)
    with pytest.raises(raised, match="injected"):
        write_checkpoint(lazy, sharded, max_shard_size=40, specs=specs_of(sd))
    assert lazy.lookups == [f"new.{i}" for i in range(5)]  # several shards were already written
    assert listing(sharded) == before
    with open_checkpoint(sharded) as reader:
        assert torch.equal(reader.get_tensor("c"), torch.full((8,), 2.0))


# --------------------------------------------------------------------------- saving over a previous checkpoint


def test_a_save_never_deletes_a_file_the_previous_index_names_but_it_did_not_write(tmp_path: Path) -> None:
    sd = {"a": torch.arange(4.0), "b": torch.ones(3)}
    write_checkpoint(sd, tmp_path, max_shard_size=16)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "README.md").write_text("notes")
    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())
    index["weight_map"].update({"x": "tokenizer.json", "y": "README.md"})
    (tmp_path / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    write_checkpoint(sd, tmp_path)  # now a single file: the old shards go, the other files stay
    assert (tmp_path / "tokenizer.json").read_text() == "{}"
    assert (tmp_path / "README.md").read_text() == "notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", SAFE_WEIGHTS_NAME, "tokenizer.json"]


@pytest.mark.parametrize("broken", ["{}", "[]", "not json", '{"weight_map": 3}', '{"weight_map": {"a": 1}}'])
def test_a_broken_previous_index_never_blocks_a_save(tmp_path: Path, broken: str) -> None:
    sd = {"a": torch.arange(4.0), "b": torch.ones(3)}
    write_checkpoint(sd, tmp_path, max_shard_size=16)
    (tmp_path / SAFE_WEIGHTS_INDEX_NAME).write_text(broken)
    write_checkpoint(sd, tmp_path, max_shard_size=16)
    with open_checkpoint(tmp_path) as reader:
        assert sorted(reader.keys()) == ["a", "b"]
        assert torch.equal(reader.get_tensor("a"), sd["a"])


# --------------------------------------------------------------------------- hostile headers and indexes

_DEEP = b"[" * 200_000 + b"]" * 200_000


@pytest.mark.parametrize(
    "header",
    [b'{"a": ' + _DEEP + b"}", b'{"__metadata__": {"x": ' + _DEEP + b"}}", _DEEP],
    ids=["entry", "metadata", "top"],
)
def test_a_header_nested_too_deeply_is_a_checkpoint_error(tmp_path: Path, header: bytes) -> None:
    path = write_raw(tmp_path / "deep.safetensors", header)
    with pytest.raises(CheckpointError, match="too deeply"):
        open_checkpoint(path)


def test_an_index_nested_too_deeply_is_a_checkpoint_error(sharded: Path) -> None:
    (sharded / SAFE_WEIGHTS_INDEX_NAME).write_bytes(b'{"weight_map": ' + _DEEP + b"}")
    with pytest.raises(CheckpointError, match="nested too deeply"):
        open_checkpoint(sharded)


@pytest.mark.parametrize(
    "shape", [[0, 2**63], [0, 2**62, 2**62], [2**40, 0, 2**40]], ids=["dim", "strides", "middle-zero"]
)
def test_an_empty_tensor_whose_strides_overflow_is_refused_at_open(tmp_path: Path, shape: list[int]) -> None:
    header = {"x": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
    path = write_raw(tmp_path / "overflow.safetensors", header)
    with pytest.raises(CheckpointError, match="overflow"):
        open_checkpoint(path)


def test_an_empty_tensor_of_sane_shape_still_opens(tmp_path: Path) -> None:
    header = {"x": {"dtype": "F32", "shape": [0, 4096], "data_offsets": [0, 0]}}
    with open_checkpoint(write_raw(tmp_path / "empty.safetensors", header)) as reader:
        assert reader.get_tensor("x").shape == (0, 4096)


def test_an_index_file_larger_than_the_limit_is_refused_before_reading(sharded: Path) -> None:
    index = sharded / SAFE_WEIGHTS_INDEX_NAME
    with index.open("r+b") as f:
        f.truncate(100_000_001)  # sparse: nothing is read or allocated
    with pytest.raises(CheckpointError, match="more than the 100000000"):
        open_checkpoint(sharded)


@pytest.mark.parametrize(
    ("offsets", "data", "needle"),
    [
        ({"a": [0, 4], "b": [8, 12]}, 12, "4 unused byte(s) after tensor 'a', before 'b'"),
        ({"a": [4, 8]}, 8, "at the start of the data"),
        ({"a": [0, 4]}, 8, "4 byte(s) after the last tensor"),
        ({"a": [0, 4], "z": [2, 2]}, 4, "overlap"),
    ],
    ids=["hole", "leading-hole", "trailing-bytes", "zero-size-inside"],
)
def test_the_reader_is_as_strict_as_safetensors_about_the_data_section(
    tmp_path: Path, offsets, data, needle
) -> None:
    """Holes, trailing bytes and misplaced zero-size tensors are refused, as the safetensors package does."""
    from safetensors import safe_open

    header = {
        k: {"dtype": "F32", "shape": [(b - a) // 4], "data_offsets": [a, b]} for k, (a, b) in offsets.items()
    }
    path = write_raw(tmp_path / "odd.safetensors", header, bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        open_checkpoint(path)
    with pytest.raises(Exception), safe_open(path, "pt") as f:  # noqa: B017 - safetensors' own error type
        f.keys()


def test_a_zero_size_tensor_where_the_previous_one_ended_is_fine(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "empty": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
    }
    path = write_raw(tmp_path / "ok.safetensors", header, struct.pack("<2f", 1.0, 2.0))
    with open_checkpoint(path) as reader:
        assert reader.get_tensor("empty").shape == (0,) and reader.get_tensor("b").tolist() == [2.0]
