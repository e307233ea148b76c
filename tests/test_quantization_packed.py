"""GPTQ and AWQ layouts, and packed runtime modules (KeepPacked / PackedLinear).

Fixtures are written here from the documented layouts (no reference packer installs on CPU:
AutoGPTQ/AutoAWQ need CUDA); the reference decode below reads every code with Python integer
arithmetic, one element at a time, independently of surgery's vectorized unpacking.
"""

from __future__ import annotations

import json
from pathlib import Path

import fp8_reference
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from packed_reference import awq_reference, awq_tensors, gptq_reference, gptq_tensors
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import surgery
from surgery.errors import ConfigurationError, ConversionError
from surgery.quantization import (
    AWQQuantizer,
    FP8BlockQuantizer,
    GPTQQuantizer,
    KeepPacked,
    PackedLinear,
    pack_words,
    unpack_words,
)

K, N, GROUP = 96, 48, 32  # three groups of in-features; 48 = 1.5 groups: an edge group for `down`


class Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.up = nn.Linear(K, N, bias=True, dtype=dtype)
        self.down = nn.Linear(N, K, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _prefixed(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v for k, v in tensors.items()}


def _checkpoint(tmp_path, name: str, tensors: dict[str, torch.Tensor], config: dict) -> str:
    d = tmp_path / name
    d.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "tiny", "quantization_config": config}))
    return str(d)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (``torch.equal`` has no float8 kernel on CPU)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _read_all(path: str) -> dict[str, torch.Tensor]:
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


GPTQ_CONFIG = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": GROUP,
    "desc_act": True,
    "sym": False,
    "damp_percent": 0.01,
    "checkpoint_format": "gptq",
    "true_sequential": True,
}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """Per format: (checkpoint dir, stored tensors, quantizer, reference (N, K) weights by linear)."""
    tmp = tmp_path_factory.mktemp("packed")
    bias = torch.randn(N, generator=torch.Generator().manual_seed(9))
    out = {}
    up, down = (
        gptq_tensors(K, N, GROUP, seed=1, act_order=True),
        gptq_tensors(N, K, GROUP, seed=2, act_order=False),
    )
    stored = {**_prefixed("up", up), **_prefixed("down", down), "up.bias": bias}
    path = _checkpoint(tmp, "gptq", stored, GPTQ_CONFIG)
    refs = {"up": gptq_reference(up), "down": gptq_reference(down)}
    out["gptq"] = (path, stored, GPTQQuantizer.from_config(GPTQ_CONFIG), refs)
    up, down = awq_tensors(K, N, GROUP, seed=3), awq_tensors(N, K, GROUP, seed=4)
    stored = {**_prefixed("up", up), **_prefixed("down", down), "up.bias": bias}
    path = _checkpoint(tmp, "awq", stored, AWQ_CONFIG)
    refs = {"up": awq_reference(up, GROUP), "down": awq_reference(down, GROUP)}
    out["awq"] = (path, stored, AWQQuantizer.from_config(AWQ_CONFIG), refs)
    gen = torch.Generator().manual_seed(5)
    w_up, w_down = torch.randn(N, K, generator=gen), torch.randn(K, N, generator=gen)
    q_up, s_up = fp8_reference.quantize(w_up, (16, 32))
    q_down, s_down = fp8_reference.quantize(w_down, (16, 32))
    stored = {
        "up.weight": q_up,
        "up.weight_scale_inv": s_up,
        "down.weight": q_down,
        "down.weight_scale_inv": s_down,
        "up.bias": bias,
    }
    fp8_cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}
    path = _checkpoint(tmp, "fp8", stored, fp8_cfg)
    refs = {
        "up": fp8_reference.dequantize(q_up, s_up, (16, 32)),
        "down": fp8_reference.dequantize(q_down, s_down, (16, 32)),
    }
    out["fp8"] = (path, stored, FP8BlockQuantizer.from_config(fp8_cfg), refs)
    return out


FORMATS = ("gptq", "awq", "fp8")


@pytest.mark.parametrize("fmt", ("gptq", "awq"))
def test_decode_equals_the_reference_decode_bit_for_bit(formats, fmt):
    _, stored, quantizer, refs = formats[fmt]
    for linear in ("up", "down"):
        key = f"{linear}.qweight"
        companions = {k: v for k, v in stored.items() if k.startswith(linear + ".") and k != key}
        got = quantizer.decode(key, stored[key], companions)
        assert got.dtype == torch.float32
        assert torch.equal(got, refs[linear]), linear


@pytest.mark.parametrize("fmt", ("gptq", "awq"))
def test_encode_of_the_decoded_weight_gives_back_the_stored_bytes(formats, fmt):
    _, stored, quantizer, refs = formats[fmt]
    for linear in ("up", "down"):
        key = f"{linear}.qweight"
        companions = {
            k: v for k, v in stored.items() if k.startswith(linear + ".") and k not in (key, "up.bias")
        }
        encoded = quantizer.encode(key, refs[linear], companions)
        assert set(encoded) == {key, *companions}
        for k, v in encoded.items():
            assert _same(v, stored[k]), k


def test_encode_of_a_changed_weight_moves_the_codes(formats):
    _, stored, quantizer, refs = formats["gptq"]
    companions = {
        k: v for k, v in stored.items() if k.startswith("up.") and k not in ("up.qweight", "up.bias")
    }
    changed = refs["up"].clone()
    changed[0, 0] += 10.0  # far beyond its group's range: clamps to a code, never wraps around
    q = quantizer.encode("up.qweight", changed, companions)["up.qweight"]
    assert not torch.equal(q, stored["up.qweight"])
    redecoded = quantizer.decode("up.qweight", q, companions)
    assert torch.equal(redecoded[1:], refs["up"][1:]) and redecoded[0, 0] > refs["up"][0, 0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_keep_packed_loads_1_to_1_forwards_as_decoded_and_saves_the_same_bytes(formats, fmt, tmp_path):
    path, stored, quantizer, refs = formats[fmt]
    model = Tiny()
    report = surgery.load_checkpoint(model, path, quantizer=KeepPacked(quantizer, checkpoint=path))
    assert not report.missing_keys and not report.unexpected_keys and not report.conversion_errors
    for linear in ("up", "down"):
        module = getattr(model, linear)
        assert isinstance(module, PackedLinear)
        for name in module.packed_names:  # held as stored: name, dtype and bytes
            held, want = getattr(module, name), stored[f"{linear}.{name}"]
            assert _same(held, want), (linear, name)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    hidden = torch.relu(F.linear(x, refs["up"], stored["up.bias"]))
    assert torch.equal(model(x), F.linear(hidden, refs["down"]))
    surgery.save_checkpoint(model, tmp_path / "out")
    written = _read_all(str(tmp_path / "out"))
    assert written.keys() == stored.keys()
    for k, v in stored.items():
        assert _same(written[k], v), k
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    original = json.loads((Path(path) / "config.json").read_text())
    assert config["quantization_config"] == original["quantization_config"]  # every field, as read
    assert "transformers_weights" not in config  # no refusal: transformers reads it as it read the source


def test_a_4_bit_checkpoint_kept_packed_takes_about_a_quarter_of_bf16_memory(formats):
    path, _, quantizer, _ = formats["gptq"]
    packed, dense = Tiny(), Tiny(torch.bfloat16)
    surgery.load_checkpoint(packed, path, quantizer=KeepPacked(quantizer, checkpoint=path))

    def nbytes(m: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))

    ratio = nbytes(packed) / nbytes(dense)
    # codes: 1/4 of bf16; per 32-column group a float16 scale, a 4-bit zero and an int32 g_idx per column
    assert 0.25 < ratio < 0.4, ratio


def test_keep_packed_only_where_targeted(formats):
    path, _, quantizer, refs = formats["fp8"]
    model = Tiny()
    surgery.load_checkpoint(model, path, quantizer=KeepPacked(quantizer, checkpoint=path, targets=("up",)))
    assert isinstance(model.up, PackedLinear) and isinstance(model.down, nn.Linear)
    assert torch.equal(model.down.weight, refs["down"])  # decoded on load as the quantizer does


def test_keep_packed_refuses_a_quantizer_without_decode():
    with pytest.raises(ConfigurationError, match="companions and decode"):
        KeepPacked(surgery.quantization.Int8WeightOnlyQuantizer(), checkpoint=".")


def test_wrong_companions_are_errors_naming_the_key(formats):
    _, stored, quantizer, _ = formats["gptq"]
    companions = {
        k: v for k, v in stored.items() if k.startswith("up.") and k not in ("up.qweight", "up.bias")
    }
    with pytest.raises(ConversionError, match=r"'up\.g_idx'"):
        quantizer.decode(
            "up.qweight", stored["up.qweight"], {k: v for k, v in companions.items() if k != "up.g_idx"}
        )
    with pytest.raises(ConversionError, match=r"'up\.qzeros' is torch.int64"):
        quantizer.decode(
            "up.qweight", stored["up.qweight"], {**companions, "up.qzeros": companions["up.qzeros"].long()}
        )
    with pytest.raises(ConversionError, match=r"'up\.scales' has shape"):
        quantizer.decode(
            "up.qweight", stored["up.qweight"], {**companions, "up.scales": companions["up.scales"][:1]}
        )
    with pytest.raises(ConversionError, match=r"'up\.scales'.*nan"):
        quantizer.check("up.scales", torch.tensor([[float("nan")]], dtype=torch.float16))


@pytest.mark.parametrize(
    "config", [{"quant_method": "awq", "version": "gemv"}, {"quant_method": "awq", "bits": 8}]
)
def test_awq_refuses_what_it_does_not_read(config):
    with pytest.raises(ConfigurationError, match="AWQQuantizer reads"):
        AWQQuantizer.from_config(config)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from((2, 4, 8)),
    rows=st.integers(1, 3),
    words=st.integers(1, 3),
    order=st.permutations(range(8)),
    seed=st.integers(0, 2**16),
)
def test_pack_and_unpack_words_are_inverse(bits, rows, words, order, seed):
    f = 32 // bits
    codes = torch.randint(0, 1 << bits, (rows, words * f), generator=torch.Generator().manual_seed(seed))
    perm = list(order) if bits == 4 else None
    for dim in (0, 1):
        c = codes if dim == 1 else codes.T
        packed = pack_words(c, bits=bits, dim=dim, order=perm)
        assert packed.dtype == torch.int32 and packed.shape[dim] == words
        assert torch.equal(unpack_words(packed, bits=bits, dim=dim, order=perm), c.to(torch.int32))


@pytest.fixture(scope="module")
def gptq_plain(tmp_path_factory):
    """A GPTQ checkpoint without act-order (the int4 kernel's layout)."""
    up, down = (
        gptq_tensors(K, N, GROUP, seed=6, act_order=False),
        gptq_tensors(N, K, GROUP, seed=7, act_order=False),
    )
    stored = {**_prefixed("up", up), **_prefixed("down", down), "up.bias": torch.zeros(N)}
    cfg = {**GPTQ_CONFIG, "desc_act": False}
    path = _checkpoint(tmp_path_factory.mktemp("plain"), "gptq", stored, cfg)
    return (
        path,
        stored,
        GPTQQuantizer.from_config(cfg),
        {"up": gptq_reference(up), "down": gptq_reference(down)},
    )


@pytest.mark.parametrize("fmt", ("gptq", "awq"))
def test_the_int4_kernel_runs_where_its_rules_allow_and_agrees_with_the_decode(
    formats, gptq_plain, fmt, tmp_path
):
    path, stored, quantizer, refs = gptq_plain if fmt == "gptq" else formats["awq"]
    model = Tiny()
    surgery.load_checkpoint(model, path, quantizer=KeepPacked(quantizer, checkpoint=path, kernel=True))
    assert surgery.quantization.int4_kernel_usable("cpu", in_features=K, out_features=N, group_size=GROUP)
    assert not surgery.quantization.int4_kernel_usable(
        "cpu", in_features=K, out_features=40, group_size=GROUP
    )
    assert model.up.int4_operands() is not None  # 96 in-features in groups of 32
    assert model.down.int4_operands() is None  # 48 in-features: not a multiple of 32, decoded instead
    for m in (1, 32):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        want = F.linear(x, refs["up"], stored["up.bias"])
        got = model.up(x)
        # bfloat16 activations, scales and zeros: agreement to bfloat16 precision, not bit for bit
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())), (
            (got - want).abs().max()
        )
    h = torch.randn(2, N)
    assert torch.equal(model.down(h), F.linear(h, refs["down"]))  # the decode path is exact
    surgery.save_checkpoint(model, tmp_path / "out")  # the kernel's copy is not state: the save is unchanged
    written = _read_all(str(tmp_path / "out"))
    assert written.keys() == stored.keys() and all(_same(written[k], v) for k, v in stored.items())


def test_the_int4_kernel_is_not_used_for_act_order_or_without_kernel(formats, gptq_plain):
    path, _, quantizer, _ = formats["gptq"]  # act-order g_idx
    model = Tiny()
    surgery.load_checkpoint(model, path, quantizer=KeepPacked(quantizer, checkpoint=path, kernel=True))
    assert model.up.int4_operands() is None
    path, _, quantizer, _ = gptq_plain
    surgery.load_checkpoint(model := Tiny(), path, quantizer=KeepPacked(quantizer, checkpoint=path))
    assert model.up.int4_operands() is None


def test_the_int4_operands_follow_a_change_of_the_stored_tensors(gptq_plain):
    path, _, quantizer, _ = gptq_plain
    model = Tiny()
    surgery.load_checkpoint(model, path, quantizer=KeepPacked(quantizer, checkpoint=path, kernel=True))
    before = model.up.int4_operands()
    assert before is not None and model.up.int4_operands() is before  # built once
    model.up.scales.mul_(2)  # an in-place write: the kernel's copy is stale
    after = model.up.int4_operands()
    assert after is not None and torch.equal(
        after[1][..., 0], (before[1][..., 0].float() * 2).to(torch.bfloat16)
    )


def _stored_part(t: torch.Tensor, region) -> torch.Tensor:
    return torch.cat([t.narrow(region.dim, a, b - a) for a, b in region.intervals], region.dim)


@pytest.mark.parametrize("fmt", ("gptq", "awq"))
@pytest.mark.parametrize(
    "dim,intervals",
    [(0, [(0, 24)]), (0, [(24, 48)]), (1, [(0, 48)]), (1, [(48, 96)]), (1, [(8, 16), (32, 40)])],
)
def test_a_split_reads_only_its_words_and_decodes_to_the_slice_of_the_full_decode(
    formats, fmt, dim, intervals
):
    from surgery.parallel.regions import Region

    _, stored, quantizer, refs = formats[fmt]
    region = Region.of(dim, intervals)
    key = "up.qweight"
    companions = {k: v for k, v in stored.items() if k.startswith("up.") and k not in (key, "up.bias")}
    part_region = quantizer.stored_region(key, region, None)
    part = _stored_part(stored[key], part_region)
    covered = sum(b - a for a, b in intervals)
    assert (
        part.numel() * refs["up"].shape[dim] == stored[key].numel() * covered
    )  # only this share of the words
    got = quantizer.decode(key, part, companions, region)
    assert torch.equal(got, _stored_part(refs["up"], region))


def test_a_split_of_the_in_features_reads_the_groups_they_fall_in_unless_act_order_scatters_them(
    formats, gptq_plain
):
    from surgery.parallel.regions import Region

    region = Region.of(1, [(GROUP, 2 * GROUP)])  # the in-features of group 1
    _, stored, plain, _ = gptq_plain
    assert plain.companion_region("up.qweight", "up.scales", region, None) == Region.of(0, [(1, 2)])
    assert plain.companion_region("up.qweight", "up.g_idx", region, None) == region.on(0)
    _, stored, act_order, _ = formats["gptq"]
    assert act_order.companion_region("up.qweight", "up.scales", region, None) is None  # every group
    # a file whose g_idx is not k // group_size while its config says no act-order
    lying = GPTQQuantizer.from_config({**GPTQ_CONFIG, "desc_act": False})
    companions = {
        k: v for k, v in stored.items() if k.startswith("up.") and k not in ("up.qweight", "up.bias")
    }
    part = _stored_part(stored["up.qweight"], lying.stored_region("up.qweight", region, None))
    with pytest.raises(ConversionError, match=rf"up\.g_idx is not k // {GROUP}.*desc_act"):
        lying.decode("up.qweight", part, companions, region)


@pytest.mark.parametrize("fmt,dim", [("gptq", 1), ("awq", 0)])
def test_a_split_inside_a_packed_word_is_a_configuration_error_naming_key_dim_and_factor(formats, fmt, dim):
    from surgery.parallel.regions import Region

    _, _, quantizer, _ = formats[fmt]
    with pytest.raises(
        ConfigurationError, match=rf"'up\.qweight'.*dim {dim}.*\[0, 12\).*8 codes per int32 word"
    ):
        quantizer.stored_region("up.qweight", Region.of(dim, [(0, 12)]), None)


# ---------------------------------------------------------------- decode on load
@pytest.mark.parametrize("fmt", ("gptq", "awq"))
def test_decode_on_load_is_exact_and_an_as_loaded_save_gives_back_every_byte_and_the_config(
    formats, fmt, tmp_path
):
    path, stored, quantizer, refs = formats[fmt]
    model = Tiny()
    report = surgery.load_checkpoint(model, path, quantizer=quantizer)
    assert not report.conversion_errors and not report.missing_keys and not report.unexpected_keys
    assert report.decoded_keys == ["down.qweight", "up.qweight"]  # checkpoint order
    assert torch.equal(model.up.weight, refs["up"]) and torch.equal(model.down.weight, refs["down"])
    saved = surgery.save_checkpoint(model, tmp_path / "same")
    written = _read_all(str(tmp_path / "same"))
    assert written.keys() == stored.keys() and all(_same(written[k], v) for k, v in stored.items())
    assert saved.requantized == ()
    config = json.loads((tmp_path / "same" / "config.json").read_text())["quantization_config"]
    assert config == json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    surgery.save_checkpoint(model, tmp_path / "floats", quantization="dequantized")
    floats = _read_all(str(tmp_path / "floats"))
    assert sorted(floats) == ["down.weight", "up.bias", "up.weight"]  # qweight written as weight
    assert torch.equal(floats["up.weight"], refs["up"]) and torch.equal(floats["down.weight"], refs["down"])
    with torch.no_grad():
        model.up.weight[0, 0] += 1.0
    saved = surgery.save_checkpoint(model, tmp_path / "changed")
    assert saved.requantized == ("up.qweight",)  # listed, never a silent lossy write
    assert not torch.equal(_read_all(str(tmp_path / "changed"))["up.qweight"], stored["up.qweight"])


@pytest.mark.parametrize("fmt,cls", [("gptq", GPTQQuantizer), ("awq", AWQQuantizer)])
def test_auto_reads_gptq_and_awq_configs_as_they_are(formats, fmt, cls):
    path, _, _, _ = formats[fmt]
    quantizer = surgery.quantization.quantizer_by_name("auto", path)
    assert isinstance(quantizer, cls)
    assert quantizer.quantization_config() == (GPTQ_CONFIG if fmt == "gptq" else AWQ_CONFIG)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_dequantized_save_of_a_packed_model_writes_the_decoded_floats_and_no_quantization_config(
    formats, fmt, tmp_path
):
    path, _, quantizer, refs = formats[fmt]
    model = Tiny()
    surgery.load_checkpoint(model, path, quantizer=KeepPacked(quantizer, checkpoint=path))
    surgery.save_checkpoint(model, tmp_path / "floats", quantization="dequantized")
    written = _read_all(str(tmp_path / "floats"))
    assert sorted(written) == ["down.weight", "up.bias", "up.weight"]
    assert torch.equal(written["up.weight"], refs["up"]) and torch.equal(written["down.weight"], refs["down"])
    config = json.loads((tmp_path / "floats" / "config.json").read_text())
    assert "quantization_config" not in config
    assert all(isinstance(m, PackedLinear) for m in (model.up, model.down))  # the model itself stays packed


def _rewritten(tmp_path, path: str, change) -> str:
    tensors = _read_all(path)
    change(tensors)
    config = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    return _checkpoint(tmp_path, "changed", tensors, config)


@pytest.mark.parametrize(
    "fmt,change,match",
    [
        ("gptq", lambda t: t.pop("up.scales"), r"'up\.scales' is missing"),
        (
            "fp8",
            lambda t: t.update({"up.weight_scale": t.pop("up.weight_scale_inv")}),
            r"'up\.weight_scale_inv' is missing",
        ),
        ("gptq", lambda t: t.update({"up.qzeros": t["up.qzeros"].long()}), r"'up\.qzeros' is torch\.int64"),
        ("awq", lambda t: t.update({"up.scales": t["up.scales"][:, :8]}), r"'up\.scales' has shape \(3, 8\)"),
    ],
)
def test_keep_packed_refuses_missing_misnamed_or_wrong_companions_naming_the_key(
    formats, tmp_path, fmt, change, match
):
    path, _, quantizer, _ = formats[fmt]
    bad = _rewritten(tmp_path, path, change)
    model = Tiny()
    with pytest.raises(ConversionError, match=match):
        surgery.load_checkpoint(model, bad, quantizer=KeepPacked(quantizer, checkpoint=bad))
    assert type(model.up) is nn.Linear  # the swap is undone: nothing loads as raw codes


def test_keep_packed_checks_the_scale_values_before_loading(formats, tmp_path):
    path, _, quantizer, _ = formats["gptq"]
    bad = _rewritten(tmp_path, path, lambda t: t["up.scales"].__setitem__((0, 0), float("nan")))
    with pytest.raises(surgery.LoadError, match=r"'up\.scales'.*nan"):
        surgery.load_checkpoint(Tiny(), bad, quantizer=KeepPacked(quantizer, checkpoint=bad), strict=True)


@pytest.mark.parametrize("bits", [2, 8])
def test_gptq_2_and_8_bit_decode_equals_the_reference_and_encodes_back(bits):
    t = gptq_tensors(64, 48, 16, seed=bits, act_order=True, bits=bits)
    quantizer = GPTQQuantizer.from_config({"quant_method": "gptq", "bits": bits, "group_size": 16})
    companions = {f"x.{k}": v for k, v in t.items() if k != "qweight"}
    decoded = quantizer.decode("x.qweight", t["qweight"], companions)
    assert torch.equal(decoded, gptq_reference(t, bits))
    assert _same(quantizer.encode("x.qweight", decoded, companions)["x.qweight"], t["qweight"])


@pytest.mark.parametrize("kind", ["int4-asym-g16", "int8-channel", "fp8-channel"])
def test_keep_packed_serves_compressed_tensors_through_its_decode(tmp_path, kind):
    from ct_reference import Net, reference_weights, scheme, write_compressed

    quant = {
        "int4-asym-g16": scheme(num_bits=4, strategy="group", group_size=16, symmetric=False),
        "int8-channel": scheme(num_bits=8, strategy="channel"),
        "fp8-channel": scheme("FP8"),
    }[kind]
    shapes = {"a": (N, K), "b": (K, N), "head": (8, K)}
    path = tmp_path / "ct"
    stored = write_compressed(path, shapes, quant)
    refs = reference_weights(path, stored)
    model = Net(shapes)
    quantizer = surgery.quantization.quantizer_by_name("auto", path)
    report = surgery.load_checkpoint(model, path, quantizer=KeepPacked(quantizer, checkpoint=path))
    assert report.ok, report
    assert isinstance(model.a, PackedLinear) and isinstance(model.b, PackedLinear)
    assert type(model.head) is nn.Linear  # stored in float (ignored by the scheme)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(model.a(x), F.linear(x, refs["a.weight"].to(torch.bfloat16)))
    surgery.save_checkpoint(model, tmp_path / "out")
    written = _read_all(str(tmp_path / "out"))
    assert written.keys() == stored.keys() and all(_same(written[k], v) for k, v in stored.items())


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_a_compressed_tensors_int4_group_checkpoint_runs_the_int4_kernel(tmp_path, symmetric):
    from ct_reference import Net, reference_weights, scheme, write_compressed

    quant = scheme(num_bits=4, strategy="group", group_size=GROUP, symmetric=symmetric)
    shapes = {"a": (N, K), "b": (24, K), "head": (8, K)}  # b: 24 out-features, not a multiple of 16
    path = tmp_path / "ct"
    stored = write_compressed(path, shapes, quant)
    refs = reference_weights(path, stored)
    model = Net(shapes)
    quantizer = KeepPacked(surgery.quantization.quantizer_by_name("auto", path), checkpoint=path, kernel=True)
    assert surgery.load_checkpoint(model, path, quantizer=quantizer).ok
    assert model.a.int4_operands() is not None
    assert model.b.int4_operands() is None  # the kernel's shape rule: decoded instead, exactly
    for m in (1, 32):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        want = F.linear(x, refs["a.weight"])
        got = model.a(x)
        # bfloat16 activations, scales and zeros: agreement to bfloat16 precision, not bit for bit
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())), (
            (got - want).abs().max()
        )
    x = torch.randn(2, K)
    assert torch.equal(model.b(x), F.linear(x, refs["b.weight"]))
    surgery.save_checkpoint(model, tmp_path / "out")  # the kernel's copy is not state
    written = _read_all(str(tmp_path / "out"))
    assert written.keys() == stored.keys() and all(_same(written[k], v) for k, v in stored.items())
