"""Interop: loading and exporting through the patch_embeddings fusion, against transformers' own.

transformers fuses the same modules with ``from_pretrained(..., fusion_config={"patch_embeddings":
True})``: it swaps ``PatchEmbed`` / ``Qwen3VLVisionPatchEmbed`` for a ``Fused*`` subclass with a
``linear_proj`` child and converts ``patch_embed.proj.weight`` with ``Conv3dToLinear``. Its patches
and conversion entries are process-global and never undone, so every transformers fusion runs in a
child process: this file run as a script (``_transformers_side``), once per model family, both
families at once. The child only ever loads *fused* models (the unfused reference is loaded here,
where no transformers fusion ever runs), so what leaks from one of its loads into the next cannot
change what it reports. This process never calls transformers with a fusion config, nor
``from_pretrained`` on a directory whose ``config.json`` holds one.

Per family (tiny random Qwen2-VL and Qwen3-VL saved by ``save_pretrained`` in the hub layout):

* ours: :func:`surgery.apply_fusions` keeps the visual tower's output and gives transformers'
  fused state-dict layout; :func:`surgery.load_checkpoint` with a fusion config loads the hub
  checkpoint correctly and exports it back bit for bit;
* ours → theirs: ``save_checkpoint(original_format=False)`` loads in transformers' fused model;
* theirs → ours: transformers' fused ``save_pretrained(save_original_format=False)`` loads into our
  fused model, and its persisted ``fusion_config`` (in ``config.json``) is re-applied by our loader.

transformers' own fused load of Qwen2-VL is broken (5.23): its fusion registers the converter under
the root ``model_type`` ``"qwen2_vl"``, but ``Qwen2VLForConditionalGeneration`` and ``Qwen2VLModel``
have class-name entries, which win, so the converter is never consulted. The module is swapped
anyway and ``linear_proj.weight`` stays randomly initialised (the checkpoint's ``proj.weight`` is
reported unexpected). So values are compared with transformers' fused model only for Qwen3-VL; for
Qwen2-VL our side is checked against transformers' *unfused* load, and theirs → ours against the
file transformers wrote.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

import surgery  # noqa: E402
from surgery.fusion import fusion_registry_snapshot  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("isolated_fusion_registry")]

T = transformers
ON = {"patch_embeddings": True}
CHILD_TIMEOUT_S = 300


# --------------------------------------------------------------------------- tiny models
def qwen2_vl_config() -> Any:
    return T.Qwen2VLConfig(
        text_config=dict(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=99,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=32,
            mlp_ratio=4,
            num_heads=4,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        image_token_id=3,
        video_token_id=4,
        vision_start_token_id=5,
        vision_end_token_id=6,
        tie_word_embeddings=True,
    )


def qwen3_vl_config() -> Any:
    return T.Qwen3VLConfig(
        text_config=dict(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=99,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [16, 8, 8],
                "mrope_interleaved": True,
                "rope_theta": 10000.0,
            },
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=32,
            out_hidden_size=32,
            num_heads=4,
            patch_size=16,
            spatial_merge_size=1,
            temporal_patch_size=2,
            in_channels=3,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
        ),
        image_token_id=3,
        video_token_id=4,
        vision_start_token_id=5,
        vision_end_token_id=6,
        tie_word_embeddings=True,
    )


@dataclass(frozen=True)
class Family:
    """One transformers model family with a fusable patch embedding."""

    name: str
    model_class: str
    config: Callable[[], Any]
    fused_class: str  # transformers' name for the fused module (ours is the same)

    def build(self) -> Any:
        """A fresh, unfused model with random weights (from the global RNG)."""
        model = getattr(T, self.model_class)(self.config()).eval()
        assert not type(model.model.visual.patch_embed).__name__.startswith("Fused"), (
            "a transformers fusion patch leaked into this process"
        )
        return model

    def load_unfused(self, directory: Path) -> Any:
        """transformers' own unfused load (never with a fusion config: that would patch this process)."""
        assert "fusion_config" not in json.loads((directory / "config.json").read_text())
        return getattr(T, self.model_class).from_pretrained(directory).eval()


FAMILIES = {
    "qwen2_vl": Family("qwen2_vl", "Qwen2VLForConditionalGeneration", qwen2_vl_config, "FusedPatchEmbed"),
    "qwen3_vl": Family(
        "qwen3_vl", "Qwen3VLForConditionalGeneration", qwen3_vl_config, "FusedQwen3VLVisionPatchEmbed"
    ),
}


def visual_outputs(model: Any) -> dict[str, torch.Tensor]:
    """The visual tower's outputs on fixed flattened patches (16 patches, grid 1x4x4)."""
    vc = model.config.vision_config
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, vc.in_channels * vc.temporal_patch_size * vc.patch_size**2, generator=gen)
    with torch.no_grad():
        out = model.model.visual(pixels, grid_thw=grid)
    return {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output}


def layout(model: Any) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def assert_outputs_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


# --------------------------------------------------------------------------- transformers side (child)
def _transformers_side(family: Family, workdir: Path) -> None:
    """Run transformers' fusion on ``workdir``'s checkpoints; write ``child.json`` and ``child.safetensors``.

    * ``theirs``: ``from_pretrained(original, fusion_config=ON)``, then ``save_pretrained(theirs,
      save_original_format=False)`` (runtime layout, ``fusion_config`` in ``config.json``);
    * ``from_ours``: ``from_pretrained(ours, fusion_config=ON)`` of our runtime-layout save.
    """
    T.logging.set_verbosity_error()
    T.utils.logging.disable_progress_bar()
    cls = getattr(T, family.model_class)
    result: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, source in (("theirs", "original"), ("from_ours", "ours")):
        model, info = cls.from_pretrained(workdir / source, fusion_config=ON, output_loading_info=True)
        model.eval()
        result[name] = {
            "fused_class": type(model.model.visual.patch_embed).__name__,
            "missing_keys": sorted(info["missing_keys"]),
            "unexpected_keys": sorted(info["unexpected_keys"]),
            "layout": layout(model),
        }
        tensors.update({f"{name}.{k}": v.contiguous() for k, v in visual_outputs(model).items()})
        if name == "theirs":
            model.save_pretrained(workdir / "theirs", save_original_format=False)
    save_file(tensors, workdir / "child.safetensors")
    (workdir / "child.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------- our side (this process)
@dataclass
class Side:
    """Both sides' artifacts for one family."""

    family: Family
    workdir: Path
    reference: Any = None  # transformers' unfused from_pretrained of the hub checkpoint
    child: dict[str, Any] = field(default_factory=dict)
    child_tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def original(self) -> Path:
        return self.workdir / "original"

    @property
    def ours(self) -> Path:
        return self.workdir / "ours"

    @property
    def theirs(self) -> Path:
        return self.workdir / "theirs"

    def child_outputs(self, name: str) -> dict[str, torch.Tensor]:
        prefix = f"{name}."
        return {k[len(prefix) :]: v for k, v in self.child_tensors.items() if k.startswith(prefix)}


def _prepare(family: Family, workdir: Path) -> Side:
    """Hub checkpoint (transformers' save_pretrained) and our runtime-layout save of its fused load."""
    side = Side(family, workdir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        family.build().save_pretrained(side.original)
    side.reference = family.load_unfused(side.original)
    fused = family.build()
    report = surgery.load_checkpoint(fused, side.original, fusion_config=ON)
    assert report.ok, report
    fused.config.save_pretrained(side.ours)  # transformers needs a config.json next to the weights
    surgery.save_checkpoint(fused, side.ours, original_format=False)
    return side


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Side]:
    """Every family's hub checkpoint, unfused reference and our runtime-layout save (no child yet)."""
    T.logging.set_verbosity_error()
    T.utils.logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("fusion-interop")
    with fusion_registry_snapshot():
        return {name: _prepare(family, root / name) for name, family in FAMILIES.items()}


@pytest.fixture(scope="module")
def sides(prepared) -> dict[str, Side]:
    """:func:`prepared` plus the transformers side of every family (children run concurrently)."""
    pytest.importorskip("transformers.fusion_mapping", reason="this transformers has no fusion_config")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    script = str(Path(__file__).resolve())
    children = {
        name: subprocess.Popen(
            [sys.executable, script, name, str(side.workdir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for name, side in prepared.items()
    }
    try:
        for name, child in children.items():
            try:
                log, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                log, _ = child.communicate()
            if child.returncode != 0:
                pytest.fail(f"the transformers side of {name} failed (rc={child.returncode}):\n{log[-4000:]}")
            side = prepared[name]
            side.child = json.loads((side.workdir / "child.json").read_text())
            side.child_tensors = load_file(side.workdir / "child.safetensors")
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.communicate()
    return prepared


@pytest.fixture(params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture
def local_side(prepared, family) -> Side:
    """One family's artifacts from this process only (tests of our side alone)."""
    return prepared[family]


@pytest.fixture
def side(sides, family) -> Side:
    """One family's artifacts from both sides."""
    return sides[family]


# --------------------------------------------------------------------------- apply_fusions vs transformers
def test_apply_fusions_keeps_the_visual_tower_output(local_side):
    model = copy.deepcopy(local_side.reference)
    surgery.apply_fusions(model, ON, strict=True)
    assert type(model.model.visual.patch_embed).__name__ == local_side.family.fused_class
    assert_outputs_close(visual_outputs(model), visual_outputs(local_side.reference))


def test_apply_fusions_gives_the_state_dict_layout_of_transformers_fusion(side):
    model = copy.deepcopy(side.reference)
    surgery.apply_fusions(model, ON, strict=True)
    theirs = side.child["theirs"]
    assert type(model.model.visual.patch_embed).__name__ == theirs["fused_class"]
    assert list(layout(model).items()) == list(theirs["layout"].items())  # same keys, order, shapes


def test_fused_values_match_transformers_where_its_fusion_works(sides):
    # Qwen3-VL only: transformers' fused Qwen2-VL never loads linear_proj.weight (module docstring).
    side = sides["qwen3_vl"]
    model = copy.deepcopy(side.reference)
    surgery.apply_fusions(model, ON, strict=True)
    our_state = model.state_dict()
    theirs = load_file(side.theirs / "model.safetensors")  # their fused model, runtime layout
    assert "model.visual.patch_embed.linear_proj.weight" in theirs
    for k, v in theirs.items():
        assert torch.equal(our_state[k], v), k
    assert_outputs_close(visual_outputs(model), side.child_outputs("theirs"))


# --------------------------------------------------------------------------- checkpoints across the two
def test_our_fused_layout_checkpoint_loads_in_transformers_fused_model(side):
    assert json.loads((side.ours / "config.json").read_text())["fusion_config"] == ON
    loaded = side.child["from_ours"]
    assert loaded["fused_class"] == side.family.fused_class
    assert loaded["missing_keys"] == [] and loaded["unexpected_keys"] == []
    assert_outputs_close(side.child_outputs("from_ours"), visual_outputs(side.reference))


def test_transformers_fused_layout_checkpoint_loads_into_our_fused_model(side):
    model = side.family.build()
    surgery.apply_fusions(model, ON, strict=True)
    report = surgery.load_checkpoint(model, side.theirs)
    assert report.ok, report
    state = model.state_dict()
    written = load_file(side.theirs / "model.safetensors")
    assert any(".patch_embed.linear_proj." in k for k in written)
    for k, v in written.items():
        assert torch.equal(state[k], v), k
    assert_outputs_close(visual_outputs(model), side.child_outputs("theirs"))


def test_transformers_persisted_fusion_config_is_reapplied_by_our_loader(side):
    assert json.loads((side.theirs / "config.json").read_text())["fusion_config"] == ON
    model = side.family.build()
    report = surgery.load_checkpoint(model, side.theirs)  # no fusion_config: config.json has it
    assert report.ok, report
    assert report.fusions == ON
    assert type(model.model.visual.patch_embed).__name__ == side.family.fused_class


# --------------------------------------------------------------------------- our fused load of the hub checkpoint
def test_fused_load_of_the_hub_checkpoint_equals_transformers_unfused_load(local_side):
    # For Qwen2-VL this is the case transformers' own fused load gets wrong.
    model = local_side.family.build()
    report = surgery.load_checkpoint(model, local_side.original, fusion_config=ON)
    assert report.ok, report
    conv = local_side.reference.model.visual.patch_embed.proj.weight
    assert torch.equal(model.model.visual.patch_embed.linear_proj.weight, conv.reshape(conv.shape[0], -1))
    assert_outputs_close(visual_outputs(model), visual_outputs(local_side.reference))


def test_saving_the_fused_load_in_original_format_reproduces_transformers_file(local_side, tmp_path):
    model = local_side.family.build()
    assert surgery.load_checkpoint(model, local_side.original, fusion_config=ON).ok
    surgery.save_checkpoint(model, tmp_path)
    want = local_side.original / "model.safetensors"
    assert (tmp_path / "model.safetensors").read_bytes() == want.read_bytes()
    got, expected = load_file(tmp_path / "model.safetensors"), load_file(want)
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())


if __name__ == "__main__":  # the transformers side, run in a child process by the ``sides`` fixture
    _transformers_side(FAMILIES[sys.argv[1]], Path(sys.argv[2]))
