"""preview_fusions changes nothing; the plan says what, where, why, before and after."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from surgery.errors import FusionError
from surgery.examples import build_vision_tower
from surgery.fusion import (
    SKIPPED,
    WOULD_FUSE,
    preview_fusions,
)
from surgery.record import record_of

ON = {"patch_embeddings": True}


pytestmark = pytest.mark.usefixtures("isolated_fusion_registry")


@pytest.fixture
def plan():
    return preview_fusions(build_vision_tower(depth=1), ON)


def test_preview_changes_nothing():
    tower = build_vision_tower(depth=1)
    modules = [(n, id(m), type(m)) for n, m in tower.named_modules()]
    tensors = {k: (id(v), v.clone()) for k, v in tower.state_dict(keep_vars=True).items()}
    attrs = {n: set(m.__dict__) for n, m in tower.named_modules()}
    preview_fusions(tower, ON)
    assert [(n, id(m), type(m)) for n, m in tower.named_modules()] == modules
    after = tower.state_dict(keep_vars=True)
    assert after.keys() == tensors.keys()
    assert all(id(after[k]) == i and torch.equal(after[k], v) for k, (i, v) in tensors.items())
    assert {n: set(m.__dict__) for n, m in tower.named_modules()} == attrs
    assert record_of(tower).fusions is None


def test_preview_candidate_reports_path_class_and_why(plan):
    (c,) = plan.candidates
    assert (c.path, c.class_name, c.status, c.fused_class_name) == (
        "patch_embed",
        "ExamplePatchEmbed",
        WOULD_FUSE,
        "FusedExamplePatchEmbed",
    )
    assert "Conv3d 'proj' (3 -> 32 channels, kernel = stride = (2, 14, 14), with bias)" in c.reason
    assert "hidden_states.view(-1, 3, 2, 14, 14)" in c.reason and "proj.view(-1, 32)" in c.reason


def test_preview_reports_parameters_before_and_after(plan):
    (c,) = plan.candidates
    assert {k: (v.shape, v.dtype) for k, v in c.params_before.items()} == {
        "proj.weight": ((32, 3, 2, 14, 14), "float32"),
        "proj.bias": ((32,), "float32"),
    }
    assert {k: (v.shape, v.dtype) for k, v in c.params_after.items()} == {
        "linear_proj.weight": ((32, 1176), "float32"),
        "linear_proj.bias": ((32,), "float32"),
    }


def test_preview_reports_graph_code_before_and_after(plan):
    (c,) = plan.candidates
    assert "self.proj(" in c.before.code and "view(-1, 3, 2, 14, 14)" in c.before.code
    assert "self.linear_proj(" in c.after.code and "view(-1, 1176)" in c.after.code
    assert "self.proj" not in c.after.code


def test_rendered_plan_has_every_section(plan):
    text = str(plan)
    assert text == plan.render()
    for section in (
        "Fusion plan (preview: nothing was changed)",
        "fusion 'patch_embeddings': would fuse 1 of 1 candidate(s)",
        "[would fuse] patch_embed (ExamplePatchEmbed -> FusedExamplePatchEmbed)",
        "why: Conv3d 'proj'",
        "parameters before:",
        "proj.weight: [32, 3, 2, 14, 14] float32",
        "parameters after:",
        "linear_proj.weight: [32, 1176] float32",
        "weight transforms (original -> fused layout):",
        "Conv3dToLinear(in_channels=3, kernel_size=(2, 14, 14))",
        "graph before:",
        "graph after:",
    ):
        assert section in text, section
    assert "graph before:" not in plan.render(graphs=False)


def test_plan_to_dict_is_json_serializable(plan):
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["config"] == {"patch_embeddings": True} and data["applied"] is False
    (c,) = data["candidates"]
    assert c["matched"] is True and c["params_after"]["linear_proj.weight"]["shape"] == [32, 1176]
    assert len(c["transforms"]) == 2 and "self.linear_proj(" in c["code_after"]


def test_plan_diagrams_show_before_and_after(plan):
    mermaid = plan.to_mermaid()
    assert mermaid.startswith("flowchart TB")
    assert 'subgraph c0_before["patch_embed (before)"]' in mermaid and "c0_after_linear_proj" in mermaid
    assert "c0_before_view --> c0_before_to" in plan.to_mermaid(full=True)
    dot = plan.to_dot()
    assert (
        dot.startswith("digraph fusion_plan {") and "cluster_c0_after" in dot and dot.rstrip().endswith("}")
    )


def test_skipped_candidate_is_in_the_plan_with_its_reason():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Conv2d(3, 4, 2, stride=2)

        def forward(self, x):
            return self.proj(x)

    model = nn.Module()
    model.patch_embed = Plain()
    plan = preview_fusions(model, ON)
    (c,) = plan.candidates
    assert c.status == SKIPPED and "has no nn.Conv3d child (children: proj (Conv2d))" in c.reason
    assert "[skipped] patch_embed (Plain)" in plan.render()
    assert "Nothing compatible found" in plan.render()


def test_nothing_compatible_found_says_what_was_looked_for():
    model = nn.Sequential(nn.Linear(2, 2))
    plan = preview_fusions(model, ON)
    message = plan.messages["patch_embeddings"]
    assert (
        "no module whose path matches" in message and "(-1, C, T, P, P)" in message and "'modules'" in message
    )
    with pytest.raises(FusionError, match="Nothing compatible found"):
        preview_fusions(model, ON, strict=True)


def test_empty_config_renders_no_fusion():
    plan = preview_fusions(build_vision_tower(depth=0), {})
    assert "no fusion enabled" in plan.render() and plan.candidates == []


# ------------------------------------------------------------------------------------------ diagram size


@pytest.fixture(scope="module")
def decoder_plan():
    """qkv and gate_up on the 2-layer example decoder: four rewritten graphs."""
    from surgery.examples.decoder import build_decoder_model

    return preview_fusions(build_decoder_model(), {"qkv": True, "gate_up": True})


def _drawn(mermaid: str, subgraph: str) -> set[str]:
    """The node names drawn in one subgraph of a Mermaid diagram (the count of the rest excluded)."""
    prefix = f"    {subgraph}_"
    return {
        line[len(prefix) :].split("[", 1)[0]
        for line in mermaid.splitlines()
        if line.startswith(prefix) and "[" in line and "__hidden" not in line
    }


def test_the_default_diagram_is_the_rewritten_region_and_its_neighbours(decoder_plan):
    small, full = decoder_plan.to_mermaid(), decoder_plan.to_mermaid(full=True)
    assert len(small.splitlines()) * 2 < len(full.splitlines())  # 219 lines against 493
    rewritten = [(i, c) for i, c in enumerate(decoder_plan.candidates) if c.after is not None]
    assert len(rewritten) == 4
    for i, c in enumerate(decoder_plan.candidates):
        if c.before is not None and c.after is None:  # not rewritten: only the count of its nodes
            assert _drawn(small, f"c{i}_before") == set()
    for i, c in rewritten:
        before, after = c.before, c.after
        for tag, snap, other in (("before", before, after), ("after", after, before)):
            changed = {n.name for n in snap.nodes if n not in set(other.nodes)}
            neighbours = {src for n in snap.nodes if n.name in changed for src in n.inputs}
            neighbours |= {n.name for n in snap.nodes if changed.intersection(n.inputs)}
            assert changed, (c.path, tag)
            assert _drawn(small, f"c{i}_{tag}") == changed | neighbours, (c.path, tag)
    assert "unchanged nodes not shown (full=True shows them)" in small
    assert "c0_after_qkv_proj" in small and "c0_before_q_proj" in small


def test_the_full_diagram_draws_every_node_and_edge(decoder_plan):
    full = decoder_plan.to_mermaid(full=True)
    for i, c in enumerate(decoder_plan.candidates):
        for tag, snap in (("before", c.before), ("after", c.after)):
            if snap is None:
                continue
            assert _drawn(full, f"c{i}_{tag}") == {n.name for n in snap.nodes}
            for n in snap.nodes:
                for src in n.inputs:
                    assert f"c{i}_{tag}_{src} --> c{i}_{tag}_{n.name}" in full
    assert "not shown" not in full
    assert "not shown" not in decoder_plan.to_dot(full=True) and "style=dashed" in decoder_plan.to_dot()
