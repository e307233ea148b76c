"""Loading through the staging ring (``load_checkpoint(..., staging_bytes=)``), on the CPU.

The ring is how a load reaches an accelerator: bounded host buffers, copies overlapped with the
next reads. On the CPU a copy thread plays the CUDA copy stream, so everything here (pieces, the
buffer reuse rule, decoding after the copy, tensor-parallel regions) runs without a GPU.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_catalog import _CONFIG, ALL_CASES, _ids, _mapping, _random, _to_runtime
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.checkpoint.format import StoredTensor
from surgery.errors import ConfigurationError
from surgery.examples.dense import build_dense_model, original_state_dict
from surgery.load.staging import BUFFERS, Staging, pieces_of, staging_budget
from surgery.registry import register_checkpoint_conversion_mapping, registry_snapshot


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------------- pieces


@st.composite
def _parts(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    dims = (
        draw(st.sets(st.integers(0, max(0, len(shape) - 1)), max_size=min(2, len(shape)))) if shape else set()
    )
    cuts = []
    for d in sorted(dims):
        bounds = sorted(draw(st.lists(st.integers(0, shape[d]), min_size=2, max_size=6)))
        iv = [(a, b) for a, b in zip(bounds[::2], bounds[1::2])]
        cuts.append((d, iv))
    item = draw(st.sampled_from([1, 2, 4, 8]))
    max_bytes = draw(st.integers(1, 200))
    return shape, cuts, item, max_bytes


@settings(max_examples=300, deadline=None)
@given(_parts())
def test_pieces_tile_the_part_in_order_and_fit_the_buffer(case) -> None:
    shape, cuts, item, max_bytes = case
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[item]
    base = 24  # the tensor's offset in the file
    whole = torch.arange(math.prod(shape), dtype=dtype).view(shape)
    file = bytearray(base) + bytearray(whole.numpy().tobytes())
    expected = whole
    for d, iv in cuts:
        expected = torch.cat(
            [expected.narrow(d, a, b - a) for a, b in iv] or [expected.narrow(d, 0, 0)], dim=d
        )
    info = StoredTensor("t", dtype, shape, Path("f.safetensors"), base, whole.nbytes)
    out = bytearray(expected.nbytes)
    pos = 0
    limit = max(item, max_bytes // item * item)
    for p in pieces_of(info, cuts, max_bytes):
        assert p.start == pos, "pieces run through the destination in order, without gaps"
        assert 0 < p.nbytes <= limit
        if not p.cuts:
            chunk = bytes(file[p.offset : p.offset + p.nbytes])
        else:
            n = math.prod(p.shape) * item
            sub = (
                torch.frombuffer(bytearray(file[p.offset : p.offset + n]), dtype=dtype).view(p.shape)
                if n
                else None
            )
            for d, iv in p.cuts:
                sub = torch.cat([sub.narrow(d, a, b - a) for a, b in iv], dim=d)
            chunk = sub.contiguous().numpy().tobytes()
        assert len(chunk) == p.nbytes
        out[p.start : p.start + p.nbytes] = chunk
        pos += p.nbytes
    assert pos == expected.nbytes
    assert bytes(out) == expected.contiguous().numpy().tobytes()


def _filler(data: bytes):
    def fill(piece, host):
        host.copy_(
            torch.frombuffer(bytearray(data[piece.offset : piece.offset + piece.nbytes]), dtype=torch.uint8)
        )

    return fill


def test_threads_sharing_one_ring_never_overwrite_a_buffer_still_being_copied() -> None:
    """Eight threads stream distinct data through four 4 KiB buffers at once; each gets its own bytes."""
    import concurrent.futures as cf

    ring = Staging(BUFFERS * 4096)
    blobs = [bytes([i]) * 4096 * 7 + bytes(range(256)) * 3 for i in range(8)]

    def one(i: int) -> bool:
        info = StoredTensor("t", torch.uint8, (len(blobs[i]),), Path("f"), 0, len(blobs[i]))
        dest = torch.empty(len(blobs[i]), dtype=torch.uint8)
        for _ in range(5):
            ring.transfer(pieces_of(info, (), ring.buffer_bytes), _filler(blobs[i]), dest)
            if dest.numpy().tobytes() != blobs[i]:
                return False
        return True

    with cf.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(8)))
    ring.close()
    assert ring.pieces == 8 * 5 * 8  # 7 full buffers and one of 768 bytes per pass


def test_a_read_failing_half_way_returns_every_buffer_to_the_ring() -> None:
    ring = Staging(BUFFERS * 4096)
    data = bytes(range(256)) * 64  # 16 KiB: four pieces
    info = StoredTensor("t", torch.uint8, (len(data),), Path("f"), 0, len(data))
    fill = _filler(data)

    def failing(piece, host):
        if piece.start >= 8192:
            raise OSError("disk gone")
        fill(piece, host)

    dest = torch.empty(len(data), dtype=torch.uint8)
    with pytest.raises(OSError, match="disk gone"):
        ring.transfer(pieces_of(info, (), ring.buffer_bytes), failing, dest)
    ring.transfer(pieces_of(info, (), ring.buffer_bytes), fill, dest)  # all four buffers are back
    assert dest.numpy().tobytes() == data
    ring.close()


def test_budget_defaults_to_a_ring_only_for_accelerators() -> None:
    assert staging_budget(None, [torch.device("cpu")]) is None
    assert staging_budget(None, [torch.device("cuda", 0)]) == 256 * 2**20
    assert staging_budget("64MiB", [torch.device("cpu")]) == 64 * 2**20
    with pytest.raises(ConfigurationError, match="too small"):
        staging_budget(100, [])
    with pytest.raises(ConfigurationError, match="Cannot parse size"):
        staging_budget("lots", [])


# --------------------------------------------------------------------------- loads


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    write_checkpoint(original_state_dict(build_dense_model(seed=0)), path)
    ref = build_dense_model(seed=1)
    assert surgery.load_checkpoint(ref, path).ok
    return path, _state(ref)


@pytest.mark.parametrize("staging_bytes", [BUFFERS * 4096, "1MiB"])
def test_a_staged_load_equals_a_direct_one(dense_checkpoint, staging_bytes) -> None:
    path, ref = dense_checkpoint
    model = build_dense_model(seed=2)
    report = surgery.load_checkpoint(model, path, staging_bytes=staging_bytes, strict=True)
    _equal(_state(model), ref)
    assert report.staged_bytes == report.bytes_read > 0
    ring = "Staging(4 x 4096 bytes)" if staging_bytes == BUFFERS * 4096 else "Staging(8 x 131072 bytes)"
    assert any(
        n.startswith(f"read through {ring}") for n in report.notes
    )  # 2 buffers per worker, if they fit


def test_a_staged_load_materializes_a_meta_model_without_mapping_the_file(dense_checkpoint) -> None:
    path, ref = dense_checkpoint
    with torch.device("meta"):
        model = build_dense_model(seed=2)
    report = surgery.load_checkpoint(model, path, staging_bytes="64KiB", strict=True)
    assert report.mapped_keys == [], "the ring replaces mmap: every tensor is read through it"
    _equal(_state(model), ref)


def test_a_tensor_larger_than_a_buffer_is_streamed_in_pieces(tmp_path) -> None:
    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(256, 96, bias=False)  # 96 KiB of float32: 24 buffers of 4 KiB
            self.norm = nn.LayerNorm(256)

    torch.manual_seed(0)
    src = Wide()
    write_checkpoint(src.state_dict(), tmp_path)
    model = Wide()
    report = surgery.load_checkpoint(model, tmp_path, staging_bytes=BUFFERS * 4096, strict=True)
    _equal(_state(model), _state(src))
    assert report.staged_bytes == sum(t.nbytes for t in src.state_dict().values())
    assert "in 26 piece(s)" in report.notes[-1]  # 24 for the weight, one each for the norm's two


def test_a_stored_quantized_checkpoint_decodes_after_the_copy(tmp_path) -> None:
    from surgery.quantization import FP8BlockQuantizer, blockwise_quantize

    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=False)
    q, scale = blockwise_quantize(linear.weight.detach(), (128, 128))
    write_checkpoint({"weight": q, "weight_scale_inv": scale}, tmp_path)
    direct, staged = nn.Linear(256, 128, bias=False), nn.Linear(256, 128, bias=False)
    quantizer = FP8BlockQuantizer(block_size=(128, 128))
    surgery.load_checkpoint(direct, tmp_path, quantizer=quantizer, strict=True)
    report = surgery.load_checkpoint(
        staged, tmp_path, quantizer=quantizer, staging_bytes="16KiB", strict=True
    )
    assert report.staged_bytes == q.nbytes  # the scales were read (and checked) by planning, on the host
    assert torch.equal(direct.weight, staged.weight)
    out = tmp_path / "back"
    surgery.save_checkpoint(staged, out, quantization="as_loaded")
    from safetensors.torch import load_file

    back = load_file(out / "model.safetensors")
    assert torch.equal(back["weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(back["weight_scale_inv"], scale)


def test_a_bad_staging_size_fails_before_the_model_changes(dense_checkpoint) -> None:
    path, _ = dense_checkpoint
    model = build_dense_model(seed=2)
    before = _state(model)
    with pytest.raises(ConfigurationError, match="staging_bytes=12 is too small"):
        surgery.load_checkpoint(model, path, staging_bytes=12)
    _equal(_state(model), before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_device_this_process_cannot_reach_is_a_clear_error(dense_checkpoint, device) -> None:
    path, _ = dense_checkpoint
    model = build_dense_model(seed=2)
    before = _state(model)
    with pytest.raises(ConfigurationError, match=r"this process has no cuda device.*Load to 'cpu'"):
        surgery.load_checkpoint(model, path, device=device)
    _equal(_state(model), before)


def test_a_device_that_is_not_one_is_named(dense_checkpoint) -> None:
    path, _ = dense_checkpoint
    with pytest.raises(ConfigurationError, match="device='gpu0' is not a torch device"):
        surgery.load_checkpoint(build_dense_model(seed=2), path, device="gpu0")


def test_peak_memory_of_a_staged_load_is_the_model_and_the_ring(tmp_path) -> None:
    """A converting load of one 64 MiB tensor through a 4 MiB ring: no second host copy of it.

    Read into a fresh tensor and then converted, the tensor would be held twice; through the ring
    the read lands in pieces straight in the destination. Measured in a fresh process (ru_maxrss).
    """
    script = textwrap.dedent(
        f"""
        import resource, torch, surgery
        from torch import nn
        from surgery.checkpoint import write_checkpoint
        path = {str(tmp_path)!r}
        write_checkpoint({{"w": torch.ones(4096, 4096)}}, path)  # 64 MiB
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.empty(4096, 4096, device="meta"))
        import gc; gc.collect()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        m = M()
        r = surgery.load_checkpoint(m, path, staging_bytes="4MiB", num_workers=1, strict=True)
        assert r.staged_bytes == 64 * 2**20 and bool((m.w == 1).all())
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
        """
    )
    grown = int(
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    )
    assert grown < (64 + 4 + 24) * 2**20, f"peak RSS grew by {grown / 2**20:.1f} MiB for a 64 MiB tensor"


# --------------------------------------------------------------------------- the catalog


class _BagConfig(type(_CONFIG)):
    """The catalog tests' config stand-in (every head count 1), naming no ``model_type``."""

    model_type = None


def _bag(case) -> nn.Module:
    """A module tree with ``case``'s runtime parameters (on meta); each scope a class registered with its list."""
    classes = {}
    for i, (key, scope) in enumerate(case.resolved):
        cls = classes[scope] = type(f"StagingBag{i}", (nn.Module,), {})
        register_checkpoint_conversion_mapping(cls.__name__, _mapping(key, case.release), overwrite=True)

    def module(path: str) -> nn.Module:
        m = classes.get(path, nn.Module)()
        m.config = _BagConfig()
        return m

    root = module("")
    for key, shape in case.runtime.items():
        *path, name = key.split(".")
        owner = root
        for depth, part in enumerate(path):
            if part not in owner._modules:
                owner.add_module(part, module(".".join(path[: depth + 1])))
            owner = owner._modules[part]
        owner.register_parameter(name, nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False))
    return root


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids(ALL_CASES))
def test_every_catalog_case_loads_bit_exact_through_the_ring(case, tmp_path) -> None:
    original = _random(case.original, seed=3)
    expected, _ = _to_runtime(original, case.transforms(), case.runtime)
    write_checkpoint(original, tmp_path)
    with registry_snapshot():
        model = _bag(case)
        report = surgery.load_checkpoint(model, tmp_path, staging_bytes=BUFFERS * 4096)
    assert report.staged_bytes == report.bytes_read
    got = {k: v for k, v in model.state_dict().items() if k in expected}
    assert not report.missing_keys and got.keys() == expected.keys(), report
    for k, t in expected.items():
        assert torch.equal(got[k], t), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_load_to_cuda_reads_through_pinned_buffers_and_equals_a_cpu_load(dense_checkpoint) -> None:
    path, ref = dense_checkpoint
    with torch.device("meta"):
        model = build_dense_model(seed=2)
    report = surgery.load_checkpoint(model, path, device="cuda", strict=True)
    assert report.staged_bytes == report.bytes_read > 0
    assert any("pinned" in n for n in report.notes)
    got = {k: v.cpu() for k, v in model.state_dict().items() if k in ref}
    assert all(v.device.type == "cuda" for v in model.parameters())
    _equal(got, {k: ref[k] for k in got})
