"""Loading and exporting through fusions: ``load_checkpoint`` / ``plan_load`` / ``save_checkpoint``.

The example vision tower (``surgery.examples.vision``) has the Qwen2-VL patch-embedding layout:
its original checkpoint stores ``patch_embed.proj.weight`` as a Conv3d kernel ``(D, C, T, P, P)``,
which the ``patch_embeddings`` fusion turns into ``patch_embed.linear_proj.weight`` ``(D, C*T*P*P)``.
Original checkpoints are written with safetensors' own writer (as the hub's are), so "bit-identical"
below means identical to a file the library did not write itself.
"""

from __future__ import annotations

import filecmp
import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import surgery
from surgery import ConfigurationError, WeightConverter, ops
from surgery.checkpoint import write_checkpoint
from surgery.examples import build_vision_tower, example_pixel_values
from surgery.examples.vision import ExamplePatchEmbed, ExampleVisionTower
from surgery.fusion import fusion_config_of
from surgery.persist import FUSION_METADATA_KEY
from surgery.record import record_of

ON = {"patch_embeddings": True}
PINNED = {"patch_embeddings": {"modules": ["^patch_embed$"]}}
"""What a runtime-layout save persists in its metadata: the fusion, pinned to the module it rewrote."""
OFF = {"patch_embeddings": False}
CONFIG_JSON = {"model_type": "example_vision", "embed_dim": 32, "patch_size": 14}


pytestmark = pytest.mark.usefixtures("isolated_fusion_registry")


# --------------------------------------------------------------------------- helpers
def tower(seed: int = 1, **kwargs) -> ExampleVisionTower:
    """A tower whose weights differ from the checkpoint's (seed 0), so a load visibly changes it."""
    return build_vision_tower(depth=1, seed=seed, **kwargs)


def write_original(
    directory: Path, *, bias: bool = True, dtype: torch.dtype = torch.float32, shard_bytes: int | None = None
) -> dict[str, torch.Tensor]:
    """Write the unfused tower's state dict (seed 0) as an original-layout checkpoint; return it."""
    state = {
        k: v.detach().clone().to(dtype)
        for k, v in build_vision_tower(depth=1, seed=0, bias=bias).state_dict().items()
    }
    if shard_bytes is None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    else:
        write_checkpoint(state, directory, max_shard_size=shard_bytes)
    return state


def files_of(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file())


def tensors_in(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def metadata_of(file: Path) -> dict[str, str]:
    with safe_open(file, "pt") as f:
        return dict(f.metadata() or {})


def assert_same_checkpoint(got: Path, want: Path) -> None:
    """Same file names, byte-identical files, and equal tensors (dtype, shape, values)."""
    assert files_of(got) == files_of(want)
    for name in files_of(want):
        if name == "config.json":
            continue
        assert filecmp.cmp(got / name, want / name, shallow=False), name
    a, b = tensors_in(got), tensors_in(want)
    assert list(a) == list(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def outputs(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(example_pixel_values(model.config, num_patches=16))


def structure(model: nn.Module) -> tuple[list, list]:
    """Module tree (names, identities, classes) and tensors (names, identities, values)."""
    return (
        [(n, id(m), type(m)) for n, m in model.named_modules()],
        [(k, id(v), v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()],
    )


def assert_same_structure(a: tuple[list, list], b: tuple[list, list]) -> None:
    assert a[0] == b[0]
    assert [(k, i) for k, i, _ in a[1]] == [(k, i) for k, i, _ in b[1]]
    assert all(torch.equal(x, y) for (_, _, x), (_, _, y) in zip(a[1], b[1]))


def poison_tensor_data(file: Path) -> None:
    """Overwrite every tensor byte with 0xFF (NaN in float32/bfloat16), keeping the header valid."""
    raw = bytearray(file.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    start = 8 + header_len
    raw[start:] = b"\xff" * (len(raw) - start)
    file.write_bytes(bytes(raw))


def save_fused_layout(source: Path, target: Path, *, persisted_in: str) -> None:
    """A runtime-layout checkpoint of the fused tower whose config lives only in ``persisted_in``.

    ``persisted_in``: ``"metadata"`` (safetensors metadata), ``"sharded-metadata"`` (the same,
    over several shards) or ``"config.json"``.
    """
    fused = tower(seed=2)
    surgery.load_checkpoint(fused, source, fusion_config=ON)
    target.mkdir(parents=True)
    if persisted_in == "config.json":
        (target / "config.json").write_text(json.dumps(CONFIG_JSON))
    shards = {"max_shard_size": 60_000} if persisted_in == "sharded-metadata" else {}
    surgery.save_checkpoint(fused, target, original_format=False, **shards)
    if shards:
        assert len(list(target.glob("*.safetensors"))) > 1
    if persisted_in == "config.json":
        # Keep the config in config.json only (as a transformers save does): rewrite the file
        # with the same tensors and no fusion metadata.
        file = target / "model.safetensors"
        save_file(load_file(file), file, metadata={"format": "pt"})


# --------------------------------------------------------------------------- fused load of an original checkpoint
@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_fused_load_of_an_original_checkpoint_computes_what_the_unfused_load_computes(tmp_path, bias, device):
    write_original(tmp_path, bias=bias)
    unfused, fused = tower(bias=bias), tower(seed=2, bias=bias, device=device)
    assert surgery.load_checkpoint(unfused, tmp_path).ok
    report = surgery.load_checkpoint(fused, tmp_path, fusion_config=ON)
    assert report.ok, report
    assert report.fusions == ON
    assert type(fused.patch_embed).__name__ == "FusedExamplePatchEmbed"
    torch.testing.assert_close(outputs(fused), outputs(unfused), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_fused_weight_is_exactly_the_reshaped_convolution_weight(tmp_path, bias):
    original = write_original(tmp_path, bias=bias)
    fused = tower(bias=bias)
    surgery.load_checkpoint(fused, tmp_path, fusion_config=ON)
    conv = original["patch_embed.proj.weight"]
    assert torch.equal(fused.patch_embed.linear_proj.weight, conv.reshape(conv.shape[0], -1))
    if bias:
        assert torch.equal(fused.patch_embed.linear_proj.bias, original["patch_embed.proj.bias"])
    else:
        assert fused.patch_embed.linear_proj.bias is None
    assert not any(k.startswith("patch_embed.proj.") for k in fused.state_dict())


# --------------------------------------------------------------------------- round trips
ORIGINALS = [
    pytest.param({}, {}, id="single-file"),
    pytest.param({"shard_bytes": 60_000}, {"max_shard_size": 60_000}, id="sharded"),
    pytest.param({"dtype": torch.bfloat16}, {}, id="bfloat16"),
]


@pytest.mark.parametrize(("written", "saved"), ORIGINALS)
def test_saving_a_fused_load_in_original_format_reproduces_the_input_files(tmp_path, written, saved):
    write_original(tmp_path / "original", **written)
    assert len(list((tmp_path / "original").glob("*.safetensors"))) == (2 if saved else 1)
    fused = tower()
    assert surgery.load_checkpoint(fused, tmp_path / "original", fusion_config=ON).ok
    surgery.save_checkpoint(fused, tmp_path / "exported", **saved)
    assert_same_checkpoint(tmp_path / "exported", tmp_path / "original")


def test_fused_layout_save_persists_the_fusion_config_in_safetensors_metadata(tmp_path):
    write_original(tmp_path / "original")
    save_fused_layout(tmp_path / "original", tmp_path / "fused", persisted_in="metadata")
    meta = metadata_of(tmp_path / "fused" / "model.safetensors")
    assert json.loads(meta[FUSION_METADATA_KEY]) == PINNED  # the exact modules it rewrote
    shapes = {
        k: tuple(v.shape) for k, v in tensors_in(tmp_path / "fused").items() if k.startswith("patch_embed.")
    }
    assert shapes == {"patch_embed.linear_proj.weight": (32, 1176), "patch_embed.linear_proj.bias": (32,)}


def test_fused_layout_save_writes_the_fusion_config_into_an_existing_config_json(tmp_path):
    write_original(tmp_path / "original")
    fused = tower()
    surgery.load_checkpoint(fused, tmp_path / "original", fusion_config=ON)
    target = tmp_path / "fused"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(CONFIG_JSON))
    surgery.save_checkpoint(fused, target, original_format=False)
    assert json.loads((target / "config.json").read_text()) == {**CONFIG_JSON, "fusion_config": ON}
    assert json.loads(metadata_of(target / "model.safetensors")[FUSION_METADATA_KEY]) == PINNED


@pytest.mark.parametrize("persisted_in", ["metadata", "sharded-metadata", "config.json"])
def test_loading_a_fused_layout_checkpoint_into_an_unfused_model_reapplies_the_fusion(tmp_path, persisted_in):
    original = write_original(tmp_path / "original")
    save_fused_layout(tmp_path / "original", tmp_path / "fused", persisted_in=persisted_in)
    reference, model = tower(), tower(seed=3)
    surgery.load_checkpoint(reference, tmp_path / "original")
    report = surgery.load_checkpoint(model, tmp_path / "fused")  # no fusion_config given
    assert report.ok, report
    expected = ON if persisted_in == "config.json" else PINNED
    assert report.fusions == expected and fusion_config_of(model) == expected
    assert type(model.patch_embed).__name__ == "FusedExamplePatchEmbed"
    conv = original["patch_embed.proj.weight"]
    assert torch.equal(model.patch_embed.linear_proj.weight, conv.reshape(conv.shape[0], -1))
    torch.testing.assert_close(outputs(model), outputs(reference), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("persisted_in", ["metadata", "sharded-metadata", "config.json"])
def test_resaving_a_reloaded_fused_layout_checkpoint_in_original_format_gives_the_original_back(
    tmp_path, persisted_in
):
    write_original(tmp_path / "original")
    save_fused_layout(tmp_path / "original", tmp_path / "fused", persisted_in=persisted_in)
    model = tower(seed=3)
    assert surgery.load_checkpoint(model, tmp_path / "fused").ok
    exported = tmp_path / "exported"
    if persisted_in == "config.json":  # a model directory: the config travels with the weights
        (tmp_path / "original" / "config.json").write_text(json.dumps(CONFIG_JSON))
        exported.mkdir()
        (exported / "config.json").write_text((tmp_path / "fused" / "config.json").read_text())
    surgery.save_checkpoint(model, exported)
    if persisted_in == "config.json":
        # The original layout carries no fusion, so the persisted config is taken out again.
        assert json.loads((exported / "config.json").read_text()) == CONFIG_JSON
    assert_same_checkpoint(exported, tmp_path / "original")


# --------------------------------------------------------------------------- collisions
def user_converter() -> WeightConverter:
    """A user converter that claims the key the fusion converts."""
    return WeightConverter(
        r"^patch_embed\.proj\.weight$", "patch_embed.proj.weight", [ops.Conv3dToLinear(3, (2, 14, 14))]
    )


@pytest.mark.parametrize("key", ["ExampleVisionTower", "example_vision"], ids=["class-name", "model_type"])
def test_fusion_transform_colliding_with_a_registered_converter_fails_before_reading_tensors(tmp_path, key):
    write_original(tmp_path)
    poison_tensor_data(tmp_path / "model.safetensors")
    model = tower()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fusion_converter = next(
        t for t in surgery.preview_fusions(tower(), ON).transforms() if isinstance(t, WeightConverter)
    )
    with surgery.registry_snapshot():
        surgery.register_checkpoint_conversion_mapping(key, [user_converter()])
        with pytest.raises(ConfigurationError) as caught:
            surgery.load_checkpoint(model, tmp_path, fusion_config=ON)
    message = str(caught.value)
    assert "patch_embed.proj.weight" in message
    assert repr(user_converter().source_patterns[0]) in message  # the user's converter ...
    assert repr(fusion_converter) in message  # ... and the fusion's, scoped to patch_embed
    # No tensor byte reached the model: every value is finite and the unfused ones are untouched.
    state = model.state_dict()
    assert all(torch.isfinite(v).all() for v in state.values())
    for k, v in before.items():
        if not k.startswith("patch_embed."):
            assert torch.equal(state[k], v), k


def test_poisoned_tensor_bytes_do_show_up_when_they_are_read(tmp_path):
    # The control for the test above: without the collision the same file loads NaNs.
    write_original(tmp_path)
    poison_tensor_data(tmp_path / "model.safetensors")
    model = tower()
    assert surgery.load_checkpoint(model, tmp_path, fusion_config=ON).ok
    assert all(torch.isnan(v).all() for v in model.state_dict().values())


# --------------------------------------------------------------------------- no global state
def test_loading_with_a_fusion_leaves_other_and_later_models_unfused(tmp_path):
    original = write_original(tmp_path)
    fused, sibling = tower(), tower()
    surgery.load_checkpoint(fused, tmp_path, fusion_config=ON)
    later = tower()
    for model in (sibling, later):
        assert type(model.patch_embed) is ExamplePatchEmbed
        assert record_of(model).fusions is None
        report = surgery.load_checkpoint(model, tmp_path)
        assert report.ok and report.fusions is None
        assert type(model.patch_embed) is ExamplePatchEmbed
        assert torch.equal(model.patch_embed.proj.weight, original["patch_embed.proj.weight"])


def test_disabled_fusion_fuses_nothing_and_loads_the_original_layout(tmp_path):
    original = write_original(tmp_path)
    model = tower()
    report = surgery.load_checkpoint(model, tmp_path, fusion_config=OFF)
    assert report.ok, report
    assert not report.fusions
    assert type(model.patch_embed) is ExamplePatchEmbed and record_of(model).fusions is None
    state = model.state_dict()
    assert list(state) == list(original)
    assert all(torch.equal(state[k], v) for k, v in original.items())


# --------------------------------------------------------------------------- plan_load
@pytest.mark.parametrize(
    ("checkpoint", "fusion_config"),
    [("original", ON), ("fused", None)],
    ids=["explicit-config", "persisted-config"],
)
def test_plan_load_with_a_fusion_leaves_the_model_unfused(tmp_path, checkpoint, fusion_config):
    write_original(tmp_path / "original")
    save_fused_layout(tmp_path / "original", tmp_path / "fused", persisted_in="metadata")
    model = tower()
    before = structure(model)
    plan = surgery.plan_load(model, tmp_path / checkpoint, fusion_config=fusion_config)
    assert plan.fusions == (ON if fusion_config else PINNED)
    assert_same_structure(structure(model), before)
    assert type(model.patch_embed) is ExamplePatchEmbed
    assert record_of(model).fusions is None and record_of(model).load is None


def test_plan_load_shows_the_fused_targets(tmp_path):
    write_original(tmp_path)
    plan = surgery.plan_load(tower(), tmp_path, fusion_config=ON)
    by_target = {e.target_keys: e for e in plan.entries}
    weight = by_target[("patch_embed.linear_proj.weight",)]
    assert weight.source_keys == ("patch_embed.proj.weight",)
    assert weight.source_shapes == ((32, 3, 2, 14, 14),) and weight.target_shapes == ((32, 1176),)
    assert "Conv3dToLinear" in weight.transform and any("Conv3dToLinear" in op for op in weight.operations)
    bias = by_target[("patch_embed.linear_proj.bias",)]
    assert bias.source_keys == ("patch_embed.proj.bias",) and bias.renamings
    assert all(e.status == "ok" for e in plan.entries) and not plan.missing_keys and not plan.unexpected_keys
    assert re.search(r"patch_embed\.linear_proj\.weight .*Conv3dToLinear", plan.render())


def test_a_fused_load_that_fails_before_reading_leaves_the_model_unfused(tmp_path: Path) -> None:
    from surgery import WeightConverter, ops
    from surgery.checkpoint import write_checkpoint
    from surgery.examples import build_vision_tower
    from surgery.fusion import fusion_config_of

    write_checkpoint(build_vision_tower(depth=1).state_dict(), tmp_path)
    model = build_vision_tower(depth=1, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    original_patch_embed = model.patch_embed
    with surgery.registry_snapshot():
        surgery.register_checkpoint_conversion_mapping(
            "example_vision",
            [
                WeightConverter(
                    r"^patch_embed\.proj\.weight$",
                    "patch_embed.proj.weight",
                    [ops.Conv3dToLinear(3, (2, 14, 14))],
                )
            ],
        )
        with pytest.raises(surgery.ConfigurationError):
            surgery.load_checkpoint(model, tmp_path, fusion_config={"patch_embeddings": True})
    assert model.patch_embed is original_patch_embed
    assert fusion_config_of(model) is None
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_a_strict_fused_load_refused_by_the_headers_leaves_the_model_unfused(tmp_path: Path) -> None:
    from surgery.checkpoint import write_checkpoint
    from surgery.errors import LoadError
    from surgery.fusion import fusion_config_of

    state = dict(build_vision_tower(depth=1, seed=0).state_dict())
    state["stray.weight"] = torch.ones(2)
    write_checkpoint(state, tmp_path)
    model = build_vision_tower(depth=1, seed=1)
    original_patch_embed = model.patch_embed
    with pytest.raises(LoadError, match="before setting any parameter"):
        surgery.load_checkpoint(model, tmp_path, fusion_config=ON, strict=True)
    assert fusion_config_of(model) is None
    assert model.patch_embed is original_patch_embed


# --------------------------------------------------------------------------- untrusted persisted configs


def _with_persisted(tmp_path: Path, config: object) -> Path:
    """A fused-layout checkpoint whose metadata carries ``config`` as its fusion config."""
    write_original(tmp_path / "original")
    save_fused_layout(tmp_path / "original", tmp_path / "fused", persisted_in="metadata")
    state = tensors_in(tmp_path / "fused")
    target = tmp_path / "crafted"
    write_checkpoint(state, target, metadata={FUSION_METADATA_KEY: json.dumps(config)})
    return target


def _load_in_child(path: str, queue) -> None:
    report = surgery.load_checkpoint(tower(), path)
    queue.put((report.fusions, report.notes))


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"patch_embeddings": {"modules": ["^(.*.*)*Z$"]}}, "not an exact module path"),
        ({"patch_embeddings": {"exclude": ["(a+)+$"]}}, "not an exact module path"),
        ({"patch_embeddings": {"modules": ["^visual\\.patch_embed$"]}}, "does not have"),
        ({"no_such_fusion": True}, "not a registered fusion"),
        (["patch_embeddings"], "not a mapping"),
    ],
)
def test_a_persisted_fusion_config_is_applied_only_as_exact_paths_the_model_has(
    tmp_path, config, why
) -> None:
    """A checkpoint cannot hang the loader with a regex, nor fuse modules the model lacks."""
    import multiprocessing as mp

    path = _with_persisted(tmp_path, config)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_load_in_child, args=(str(path), queue))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        pytest.fail("loading a checkpoint with a crafted fusion config hung")
    fusions, notes = queue.get(timeout=5)
    assert fusions is None
    (note,) = [n for n in notes if "fusion config" in n]
    assert why in note and "fusion_config=" in note


def test_a_pinned_persisted_config_fuses_exactly_the_modules_it_names(tmp_path) -> None:
    path = _with_persisted(tmp_path, PINNED)
    model = tower()
    report = surgery.load_checkpoint(model, path)
    assert report.ok and report.notes == [] and report.fusions == PINNED
    assert type(model.patch_embed).__name__ == "FusedExamplePatchEmbed"
