"""Specification of ModuleGraph: nodes, attributes, shared modules, tied parameters, helpers, rendering."""

from __future__ import annotations

from types import SimpleNamespace

import networkx as nx
import pytest
import torch
from torch import nn

from surgery.errors import ConfigurationError
from surgery.graph import ModuleGraph, ModuleTensor
from surgery.registry import register_checkpoint_conversion_mapping, registry_snapshot


@pytest.fixture(autouse=True)
def registry():
    with registry_snapshot(clear=True):
        yield


class Block(nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.attn = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)


class Decoder(nn.Module):
    def __init__(self, layers: int = 2, hidden: int = 4) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type="toy")
        self.embed_tokens = nn.Embedding(10, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)


class CausalLM(nn.Module):
    def __init__(self, layers: int = 2, hidden: int = 4, tie: bool = True) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type="toy")
        self.model = Decoder(layers, hidden)
        self.lm_head = nn.Linear(hidden, 10, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight


# ---------------------------------------------------------------------- nodes and edges
def test_there_is_one_node_per_module_path_with_the_root_as_empty_string():
    model = CausalLM()
    graph = ModuleGraph(model)
    assert list(graph) == [path for path, _ in model.named_modules()]
    assert "" in graph.graph


def test_edges_go_parent_to_child_in_named_modules_order():
    graph = ModuleGraph(CausalLM())
    assert list(graph.graph.successors("")) == ["model", "lm_head"]
    assert list(graph.graph.successors("model")) == ["model.embed_tokens", "model.layers", "model.norm"]
    assert graph.graph.edges["model", "model.layers"]["name"] == "layers"


def test_the_graph_is_a_tree_rooted_at_the_empty_path():
    graph = ModuleGraph(CausalLM())
    assert nx.is_arborescence(graph.graph)


def test_node_records_class_name_and_module():
    graph = ModuleGraph(CausalLM())
    assert graph.nodes["model.layers.0"]["class_name"] == "Block"
    assert graph.nodes["model.layers.0"]["class_module"] == __name__
    assert graph.nodes["model.layers.0.attn"]["class_name"] == "Linear"
    assert graph.nodes["model.layers.0"]["name"] == "0"


def test_node_records_own_parameters_with_shape_dtype_and_device_only():
    graph = ModuleGraph(CausalLM(hidden=4))
    attn = graph.nodes["model.layers.0.attn"]["parameters"]
    assert attn == {
        "weight": ModuleTensor((4, 4), torch.float32, torch.device("cpu")),
        "bias": ModuleTensor((4,), torch.float32, torch.device("cpu")),
    }
    assert graph.nodes["model.layers.0"]["parameters"] == {}  # own only: recurse=False


def test_a_parameter_set_to_none_is_not_recorded():
    graph = ModuleGraph(nn.Linear(2, 3, bias=False))
    assert list(graph.nodes[""]["parameters"]) == ["weight"]


def test_node_records_buffers_and_whether_they_are_persistent():
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(2, dtype=torch.int64))
    module.register_buffer("scratch", torch.zeros(3), persistent=False)
    buffers = ModuleGraph(module).nodes[""]["buffers"]
    assert buffers["kept"] == ModuleTensor((2,), torch.int64, torch.device("cpu"), None, True)
    assert buffers["scratch"].persistent is False


def test_tensor_data_is_never_needed_so_meta_models_work():
    with torch.device("meta"):
        model = CausalLM(layers=3, hidden=8)
    info = ModuleGraph(model).nodes["model.embed_tokens"]["parameters"]["weight"]
    assert info.device == torch.device("meta") and info.shape == (10, 8) and info.numel == 80


def test_a_non_module_is_rejected():
    with pytest.raises(ConfigurationError, match=r"needs a torch\.nn\.Module"):
        ModuleGraph({"weight": torch.zeros(1)})


# ---------------------------------------------------------------------- model_type and sub-models
def test_model_type_comes_from_config_and_is_none_elsewhere():
    graph = ModuleGraph(CausalLM())
    assert graph.nodes[""]["model_type"] == "toy"
    assert graph.nodes["model.layers.0"]["model_type"] is None


def test_a_config_without_model_type_gives_no_model_type():
    module = nn.Module()
    module.config = SimpleNamespace(hidden_size=4)
    node = ModuleGraph(module).nodes[""]
    assert node["model_type"] is None and node["is_submodel"] is False


def test_modules_with_their_own_config_model_type_are_sub_models():
    graph = ModuleGraph(CausalLM())
    assert [path for path, _ in graph.submodels()] == ["", "model"]


def test_a_registered_class_name_makes_a_sub_model_without_config():
    register_checkpoint_conversion_mapping("Block", [])
    graph = ModuleGraph(CausalLM())
    assert graph.nodes["model.layers.1"]["is_submodel"]
    assert graph.nodes["model.layers.1"]["model_type"] is None


class LayerWithModelConfig(nn.Module):
    """A layer that keeps its model's config, as transformers attention and MLP layers do."""

    def __init__(self, config: object) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(2, 2)


class InnerModel(nn.Module):
    base_model_prefix = "model"  # the PreTrainedModel convention

    def __init__(self, config: object) -> None:
        super().__init__()
        self.config = config
        self.layer = LayerWithModelConfig(config)


class OuterModel(nn.Module):
    base_model_prefix = "model"

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type="toy")
        self.model = InnerModel(self.config)


def test_a_layer_holding_its_models_config_is_not_a_sub_model():
    graph = ModuleGraph(OuterModel())
    assert graph.nodes["model.layer"]["model_type"] == "toy"
    assert not graph.nodes["model.layer"]["is_submodel"]


def test_a_model_class_sharing_its_parents_config_is_a_sub_model():
    graph = ModuleGraph(OuterModel())
    assert graph.nodes["model"]["is_submodel"]


def test_sub_models_are_yielded_depth_first_in_named_modules_order():
    class Tower(nn.Module):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.config = SimpleNamespace(model_type=kind)
            self.inner = nn.Linear(1, 1)

    root = nn.Module()
    root.vision = Tower("vision")
    root.vision.sub = Tower("vision_sub")
    root.text = Tower("text")
    paths = [path for path, _ in ModuleGraph(root).submodels()]
    assert paths == ["vision", "vision.sub", "text"]


def test_submodels_yield_the_module_objects():
    model = CausalLM()
    (_, root), (_, inner) = ModuleGraph(model).submodels()
    assert root is model and inner is model.model


# ---------------------------------------------------------------------- shared modules and tied parameters
def _shared_model() -> nn.Module:
    root = nn.Module()
    root.encoder = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    root.decoder = nn.Module()
    root.decoder.block = root.encoder  # the same instance under a second path
    return root


def test_a_shared_module_is_one_node_at_its_first_path_with_the_others_as_aliases():
    graph = ModuleGraph(_shared_model())
    assert "decoder.block" not in graph.graph
    assert graph.nodes["encoder"]["aliases"] == ("decoder.block",)
    assert graph.nodes["encoder.0"]["aliases"] == ("decoder.block.0",)


def test_the_subtree_of_a_shared_module_is_not_duplicated():
    graph = ModuleGraph(_shared_model())
    assert list(graph) == ["", "encoder", "encoder.0", "encoder.1", "decoder"]


def test_alias_paths_resolve_to_their_canonical_node_and_module():
    model = _shared_model()
    graph = ModuleGraph(model)
    assert "decoder.block.0" in graph
    assert graph.canonical("decoder.block.0") == "encoder.0"
    assert graph.module("decoder.block.0") is model.encoder[0]


def test_parameters_of_a_shared_module_form_tied_groups_canonical_first():
    graph = ModuleGraph(_shared_model())
    assert graph.tied_parameters() == [
        ["encoder.0.weight", "decoder.block.0.weight"],
        ["encoder.0.bias", "decoder.block.0.bias"],
    ]


def test_a_tied_parameter_is_grouped_with_its_first_name():
    graph = ModuleGraph(CausalLM(tie=True))
    assert graph.tied_parameters() == [["model.embed_tokens.weight", "lm_head.weight"]]


def test_the_second_name_of_a_tied_parameter_records_what_it_is_tied_to():
    graph = ModuleGraph(CausalLM(tie=True))
    assert graph.nodes["lm_head"]["parameters"]["weight"].tied_to == "model.embed_tokens.weight"
    assert graph.nodes["model.embed_tokens"]["parameters"]["weight"].tied_to is None


def test_untied_models_have_no_tied_groups():
    assert ModuleGraph(CausalLM(tie=False)).tied_parameters() == []


def test_tied_groups_cover_every_duplicated_state_dict_entry():
    model = CausalLM(tie=True)
    groups = ModuleGraph(model).tied_parameters()
    state = model.state_dict(keep_vars=True)
    for group in groups:
        assert all(state[key] is state[group[0]] for key in group)


# ---------------------------------------------------------------------- helpers
def test_module_returns_the_module_at_a_path():
    model = CausalLM()
    graph = ModuleGraph(model)
    assert graph.module("") is model
    assert graph.module("model.layers.1.norm") is model.model.layers[1].norm


def test_unknown_paths_raise_with_the_closest_matches():
    graph = ModuleGraph(CausalLM())
    with pytest.raises(
        ConfigurationError, match=r"no module path 'model.layer.0'.*Closest: 'model.layers.0'"
    ):
        graph.module("model.layer.0")


def test_ancestors_are_listed_nearest_first_ending_at_the_root():
    graph = ModuleGraph(CausalLM())
    assert graph.ancestors("model.layers.0.attn") == ["model.layers.0", "model.layers", "model", ""]
    assert graph.ancestors("") == []


def test_ancestors_of_an_alias_path_follow_that_path():
    graph = ModuleGraph(_shared_model())
    assert graph.ancestors("decoder.block.0") == ["encoder", "decoder", ""]


def test_subtree_lists_the_module_and_everything_below_in_order():
    graph = ModuleGraph(CausalLM(layers=1))
    assert graph.subtree("model.layers") == [
        "model.layers",
        "model.layers.0",
        "model.layers.0.attn",
        "model.layers.0.norm",
    ]


def test_owner_is_the_nearest_sub_model_containing_the_key():
    graph = ModuleGraph(CausalLM())
    assert graph.owner("model.layers.0.attn.weight") == "model"
    assert graph.owner("model.embed_tokens.weight") == "model"


def test_owner_falls_back_to_the_root():
    root = nn.Sequential(nn.Linear(1, 1))
    assert ModuleGraph(root).owner("0.weight") == ""


def test_owner_of_a_tied_key_follows_the_key_as_written():
    graph = ModuleGraph(CausalLM(tie=True))
    assert graph.owner("lm_head.weight") == ""


def test_owner_accepts_buffer_keys():
    model = CausalLM()
    model.model.register_buffer("inv_freq", torch.ones(2))
    assert ModuleGraph(model).owner("model.inv_freq") == "model"


def test_owner_of_an_unknown_key_raises_with_the_closest_matches():
    graph = ModuleGraph(CausalLM())
    with pytest.raises(
        ConfigurationError, match=r"no parameter or buffer 'model.norm.wieght'.*'model.norm.weight'"
    ):
        graph.owner("model.norm.wieght")


# ---------------------------------------------------------------------- rendering
def test_render_draws_an_indented_tree_with_classes_model_types_and_counts():
    text = ModuleGraph(CausalLM(layers=1, hidden=4, tie=False)).render()
    lines = text.splitlines()
    assert lines[0] == "CausalLM  [toy]*  116 params"
    assert "├── model: Decoder  [toy]*  76 params" in lines
    assert "│   │   └── 0: Block  28 params" in lines
    assert lines[-1] == "└── lm_head: Linear  40 params"


def test_render_collapses_runs_of_alike_numbered_siblings():
    text = ModuleGraph(CausalLM(layers=12)).render()
    assert "0..11: 12 x Block  28 params each" in text
    assert "layers.1:" not in text and " 1: Block" not in text


def test_render_keeps_siblings_that_differ_apart():
    model = CausalLM(layers=3)
    model.model.layers[1] = Block(hidden=4)
    model.model.layers[1].extra = nn.Linear(4, 1)
    text = ModuleGraph(model).render()
    assert "0: Block" in text and "1: Block" in text and "2: Block" in text


def test_render_without_collapsing_draws_every_sibling():
    text = ModuleGraph(CausalLM(layers=3)).render(collapse_repeats=False)
    assert "0: Block" in text and "1: Block" in text and "2: Block" in text


def test_render_stops_at_max_depth():
    text = ModuleGraph(CausalLM()).render(max_depth=1)
    assert text.splitlines()[1:] == [
        "├── model: Decoder  [toy]*  104 params",
        "└── lm_head: Linear  (tied: weight = model.embed_tokens.weight)",
    ]


def test_render_counts_a_tied_tensor_once():
    tied = ModuleGraph(CausalLM(tie=True)).subtree_numel("")
    untied = ModuleGraph(CausalLM(tie=False)).subtree_numel("")
    assert untied - tied == 40


def test_render_marks_shared_modules_with_their_aliases():
    assert "(also at decoder.block)" in ModuleGraph(_shared_model()).render()


def test_render_of_a_subtree_starts_at_that_path():
    text = ModuleGraph(CausalLM()).render("model.layers.0")
    assert text.splitlines()[0] == "model.layers.0: Block  28 params"


def test_str_is_the_rendered_tree():
    graph = ModuleGraph(CausalLM())
    assert str(graph) == graph.render()
    assert repr(graph) == "ModuleGraph(CausalLM: 12 modules, 2 sub-model(s))"
