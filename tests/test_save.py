"""Saving: exact round trips, idempotence, runtime layout, base-model prefix, atomicity, streaming."""

from __future__ import annotations

import filecmp
import json
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

import surgery
from surgery import WeightConverter, ops
from surgery.checkpoint import SAFE_WEIGHTS_NAME, open_checkpoint, write_checkpoint
from surgery.errors import CheckpointError, ConfigurationError, ConversionError
from surgery.examples.moe import ExampleMoEConfig, ExampleMoEModel, build_moe_model, original_state_dict
from surgery.examples.vision import build_vision_tower
from surgery.persist import FUSION_METADATA_KEY
from surgery.record import record_of
from surgery.registry import register_checkpoint_conversion_mapping, registry_snapshot
from surgery.save import RevertedState
from surgery.saved_config import TRANSFORMERS_REFUSAL

CFG = ExampleMoEConfig()
FUSE = {"patch_embeddings": True}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(path) as reader:
        return {k: reader.get_tensor(k) for k in reader}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names
    )


@dataclass(frozen=True)
class Example:
    """An example model: its original checkpoint, and how to build and load a fresh copy."""

    original: Callable[[], dict[str, torch.Tensor]]
    build: Callable[[], nn.Module]
    load_kwargs: dict


EXAMPLES = {
    "moe": Example(
        lambda: original_state_dict(build_moe_model(CFG, seed=0, dtype=torch.bfloat16)),
        lambda: build_moe_model(CFG, device="meta", dtype=torch.bfloat16),
        {},
    ),
    "vision": Example(
        lambda: build_vision_tower(depth=1, seed=0).state_dict(),
        lambda: build_vision_tower(depth=1, seed=1),
        {},
    ),
    "vision-fused": Example(
        lambda: build_vision_tower(depth=1, seed=0).state_dict(),
        lambda: build_vision_tower(depth=1, seed=1),
        {"fusion_config": FUSE},
    ),
}


@pytest.fixture(params=list(EXAMPLES), ids=list(EXAMPLES))
def example(request) -> Example:
    return EXAMPLES[request.param]


def loaded(example: Example, path: Path) -> nn.Module:
    model = example.build()
    assert surgery.load_checkpoint(model, path, **example.load_kwargs).ok
    return model


# ------------------------------------------------------------------------------------------ round trips


def test_original_checkpoint_round_trips_bit_identically(tmp_path: Path, example: Example) -> None:
    original = example.original()
    write_checkpoint(original, tmp_path / "src")
    surgery.save_checkpoint(loaded(example, tmp_path / "src"), tmp_path / "out")
    assert_same(tensors(tmp_path / "out"), original)
    assert same_files(tmp_path / "src", tmp_path / "out")


def test_load_save_load_save_writes_identical_files(tmp_path: Path, example: Example) -> None:
    original = example.original()
    write_checkpoint(original, tmp_path / "src", max_shard_size=sum(t.nbytes for t in original.values()) // 2)
    surgery.save_checkpoint(loaded(example, tmp_path / "src"), tmp_path / "a", max_shard_size="4KB")
    surgery.save_checkpoint(loaded(example, tmp_path / "a"), tmp_path / "b", max_shard_size="4KB")
    assert len(list((tmp_path / "a").iterdir())) > 2  # sharded, with an index
    assert same_files(tmp_path / "a", tmp_path / "b")


def test_runtime_layout_save_loads_back_the_same_state_dict(tmp_path: Path, example: Example) -> None:
    write_checkpoint(example.original(), tmp_path / "src")
    model = loaded(example, tmp_path / "src")
    surgery.save_checkpoint(model, tmp_path / "runtime", original_format=False)
    assert_same(tensors(tmp_path / "runtime"), model.state_dict())
    again = example.build()  # no fusion_config: a persisted one is re-applied by itself
    report = surgery.load_checkpoint(again, tmp_path / "runtime")
    fusions = example.load_kwargs.get("fusion_config")
    pinned = None if fusions is None else {name: {"modules": ["^patch_embed$"]} for name in fusions}
    assert report.ok and report.fusions == pinned  # re-applied to exactly the modules saved fused
    assert_same(again.state_dict(), model.state_dict())


def test_runtime_layout_persists_the_fusion_config(tmp_path: Path) -> None:
    model = build_vision_tower(depth=1)
    surgery.apply_fusions(model, FUSE)
    surgery.save_checkpoint(model, tmp_path, original_format=False)
    with open_checkpoint(tmp_path) as reader:
        assert reader.metadata[FUSION_METADATA_KEY] == '{"patch_embeddings": {"modules": ["^patch_embed$"]}}'
    surgery.save_checkpoint(model, tmp_path)
    with open_checkpoint(tmp_path) as reader:
        assert FUSION_METADATA_KEY not in reader.metadata
        assert "patch_embed.proj.weight" in reader


def test_a_runtime_layout_checkpoint_converts_nothing_and_saves_the_family_layout(tmp_path: Path) -> None:
    """Original format is the family's layout, however the weights arrived."""
    source = build_moe_model(CFG, seed=0)
    write_checkpoint(source.state_dict(), tmp_path / "src")
    model = build_moe_model(CFG, device="meta")
    report = surgery.load_checkpoint(model, tmp_path / "src")
    assert report.ok and report.transforms_used == []
    assert all(e.transform is None and e.renamings == () for e in report.plan.entries)
    assert record_of(model).load.transforms == []
    surgery.save_checkpoint(model, tmp_path / "out")
    assert_same(tensors(tmp_path / "out"), original_state_dict(source))  # per-expert, as the hub has it
    surgery.save_checkpoint(model, tmp_path / "runtime", original_format=False)
    assert_same(tensors(tmp_path / "runtime"), source.state_dict())


def test_dtype_cast_at_load_is_undone_on_save(tmp_path: Path) -> None:
    original = original_state_dict(build_moe_model(CFG, seed=0, dtype=torch.bfloat16))
    write_checkpoint(original, tmp_path / "src")
    model = build_moe_model(CFG, seed=3)  # float32
    report = surgery.load_checkpoint(model, tmp_path / "src")
    assert report.mismatched and {t.dtype for t in model.state_dict().values()} == {torch.float32}
    surgery.save_checkpoint(model, tmp_path / "out")
    assert same_files(tmp_path / "src", tmp_path / "out")


def test_model_never_loaded_saves_the_original_layout(tmp_path: Path) -> None:
    model = build_moe_model(CFG, seed=0)
    surgery.save_checkpoint(model, tmp_path)
    assert_same(tensors(tmp_path), original_state_dict(model))


# ------------------------------------------------------------------------------------------ base-model prefix


def base_model() -> ExampleMoEModel:
    model = ExampleMoEModel(CFG)
    assert model.base_model_prefix == "model"  # the transformers convention, declared by the class
    return model


def test_base_model_checkpoint_loads_into_the_model_with_a_head(tmp_path: Path) -> None:
    original = {k.removeprefix("model."): v for k, v in original_state_dict(build_moe_model(CFG)).items()}
    del original["lm_head.weight"]
    write_checkpoint(original, tmp_path / "src")
    model = build_moe_model(CFG, seed=3)
    report = surgery.load_checkpoint(model, tmp_path / "src")
    assert report.missing_keys == ["lm_head.weight"] and not report.unexpected_keys
    assert_same(model.model.state_dict(), build_moe_model(CFG, seed=0).model.state_dict())
    surgery.save_checkpoint(model, tmp_path / "out")
    saved = tensors(tmp_path / "out")
    assert set(saved) == {*original, "lm_head.weight"}  # the original prefix form, plus the head
    assert_same({k: v for k, v in saved.items() if k != "lm_head.weight"}, original)


def test_checkpoint_with_a_head_loads_into_the_base_model(tmp_path: Path) -> None:
    original = original_state_dict(build_moe_model(CFG))
    write_checkpoint(original, tmp_path / "src")
    model = base_model()
    report = surgery.load_checkpoint(model, tmp_path / "src")
    assert report.unexpected_keys == ["lm_head.weight"] and not report.missing_keys
    surgery.save_checkpoint(model, tmp_path / "out")
    assert_same(tensors(tmp_path / "out"), {k: v for k, v in original.items() if k != "lm_head.weight"})


# ------------------------------------------------------------------------------------------ tied weights


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(8, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


@pytest.mark.parametrize("name", ["embed_tokens.weight", "lm_head.weight"])
def test_tied_parameter_is_written_once_under_the_checkpoint_name(tmp_path: Path, name: str) -> None:
    write_checkpoint({name: torch.ones(8, 4)}, tmp_path / "src")
    model = TiedLM()
    assert surgery.load_checkpoint(model, tmp_path / "src").ok
    surgery.save_checkpoint(model, tmp_path / "out")
    assert list(tensors(tmp_path / "out")) == [name]


def test_meta_model_with_missing_parameters_refuses_to_save_naming_them(tmp_path: Path) -> None:
    sd = original_state_dict(build_moe_model(CFG))
    del sd["model.layers.0.input_layernorm.weight"], sd["model.layers.1.input_layernorm.weight"]
    write_checkpoint(sd, tmp_path / "src")
    model = build_moe_model(CFG, device="meta")
    surgery.load_checkpoint(model, tmp_path / "src")
    with pytest.raises(CheckpointError, match=r"model\.layers\.\{0\.\.1\}\.input_layernorm\.weight"):
        surgery.save_checkpoint(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ failed saves


@dataclass(frozen=True)
class FailsOnSave(ops.ConversionOp):
    """Identity when loading; its reverse raises ``failure`` on real tensors (not on meta)."""

    failure: type[BaseException] = RuntimeError
    forward: bool = True

    def convert(self, slots, ctx):
        (t,) = slots
        if not self.forward and t.device.type != "meta":
            raise self.failure("injected failure while saving")
        return [t.clone()]

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return FailsOnSave(self.failure, not self.forward)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(model_type="toy_fails_on_save")
        self.a = nn.Parameter(torch.zeros(4))
        self.b = nn.Parameter(torch.zeros(4))
        self.c = nn.Parameter(torch.zeros(4))


@pytest.mark.parametrize(
    ("failure", "raised"),
    [(RuntimeError, ConversionError), (KeyboardInterrupt, KeyboardInterrupt)],
    ids=["exception", "keyboard-interrupt"],
)
def test_failure_midway_through_a_save_leaves_the_earlier_checkpoint_loadable(
    tmp_path: Path, failure, raised
) -> None:
    with registry_snapshot():
        register_checkpoint_conversion_mapping(
            "toy_fails_on_save", [WeightConverter("^old_b$", "b", [FailsOnSave(failure)])]
        )
        write_checkpoint(
            {"a": torch.ones(4), "old_b": torch.full((4,), 2.0), "c": torch.ones(4)}, tmp_path / "src"
        )
        model = Toy()
        assert surgery.load_checkpoint(model, tmp_path / "src").ok
        surgery.save_checkpoint(model, tmp_path / "ckpt", original_format=False, max_shard_size=16)
        before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
        with pytest.raises(raised, match="injected failure while saving"):
            surgery.save_checkpoint(model, tmp_path / "ckpt", max_shard_size=16)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    again = Toy()
    assert surgery.load_checkpoint(again, tmp_path / "ckpt").ok


class _FailsToSerialize(torch.Tensor):
    """Passes every check, then fails when its bytes are about to be written."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            raise KeyboardInterrupt("injected while writing")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_interrupt_while_writing_bytes_leaves_the_earlier_checkpoint_loadable(tmp_path: Path) -> None:
    write_checkpoint(original_state_dict(build_moe_model(CFG)), tmp_path / "src")
    model = build_moe_model(CFG, device="meta")
    surgery.load_checkpoint(model, tmp_path / "src")
    surgery.save_checkpoint(model, tmp_path / "ckpt", max_shard_size="8KB")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    model.model.norm._parameters["weight"] = torch.zeros(CFG.hidden_size).as_subclass(_FailsToSerialize)
    with pytest.raises(KeyboardInterrupt, match="injected"):
        surgery.save_checkpoint(model, tmp_path / "ckpt", max_shard_size="8KB")
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    assert surgery.load_checkpoint(build_moe_model(CFG, device="meta"), tmp_path / "ckpt").ok


# ------------------------------------------------------------------------------------------ streaming


def test_reverted_state_knows_every_key_shape_and_dtype_before_computing_anything() -> None:
    model = build_moe_model(CFG, seed=0, dtype=torch.bfloat16)
    state = RevertedState(model)
    truth = original_state_dict(model)
    assert sorted(state) == sorted(truth) and len(state) == len(truth)
    assert all(state.spec(k) == (tuple(v.shape), v.dtype) for k, v in truth.items())
    assert state.cached_keys == ()


def test_reverted_state_never_holds_more_than_one_group() -> None:
    model = build_moe_model(CFG, seed=0)
    state = RevertedState(model)
    groups = {k: g for g in state.group_keys for k in g}
    largest = max(len(g) for g in state.group_keys)
    assert largest == 2 * CFG.num_local_experts  # w1 and w3 of every expert of one layer
    alive: list[weakref.ref] = []  # outputs of converter groups (a plain tensor is the model's own)
    for key in state:  # the order write_checkpoint reads in
        value = state[key]
        if len(groups[key]) > 1:
            alive.append(weakref.ref(value))
        del value
        assert set(state.cached_keys) <= set(groups[key])
        assert sum(r() is not None for r in alive) <= largest
    assert_same(dict(revert := surgery.revert_state_dict(model)), original_state_dict(model))
    del revert


class _Tracker:
    """Weak references to every tensor a reversed chain produced while saving."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.groups = 0
        self.most_alive = 0

    def see(self, tensors: list[torch.Tensor]) -> None:
        self.groups += 1
        self.refs.extend(weakref.ref(t) for t in tensors)
        self.most_alive = max(self.most_alive, sum(r() is not None for r in self.refs))


@dataclass(frozen=True)
class Tracked(ops.ConversionOp):
    """Identity; its reverse tells ``tracker`` about the real tensors it passes on."""

    tracker: _Tracker = field(compare=False)
    forward: bool = True

    def convert(self, slots, ctx):
        if not self.forward and slots[0].device.type != "meta":
            self.tracker.see(slots)
        return list(slots)

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return Tracked(self.tracker, not self.forward)

    def input_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape


class TransposedPairs(nn.Module):
    """``layers.N.ab`` is ``cat([a_t.T, b_t.T])``: saving it back copies (transposes) both halves."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(model_type="toy_transposed_pairs")
        self.layers = nn.ModuleList(nn.Module() for _ in range(n))
        for layer in self.layers:
            layer.ab = nn.Parameter(torch.zeros(12, 4))


def test_save_whose_reversed_chain_copies_holds_at_most_one_group_at_a_time(tmp_path: Path) -> None:
    tracker = _Tracker()
    original = {f"layers.{i}.{n}": torch.randn(4, 6) for i in range(4) for n in ("a_t", "b_t")}
    with registry_snapshot():
        register_checkpoint_conversion_mapping(
            "toy_transposed_pairs",
            [
                WeightConverter(
                    ["a_t", "b_t"], "ab", [Tracked(tracker), ops.Transpose(0, 1), ops.Concatenate(0)]
                )
            ],
        )
        write_checkpoint(original, tmp_path / "src")
        model = TransposedPairs()
        assert surgery.load_checkpoint(model, tmp_path / "src").ok
        surgery.save_checkpoint(model, tmp_path / "out", max_shard_size=200)
    assert tracker.groups == 4
    assert tracker.most_alive == 2  # a_t and b_t of one layer; never two layers' copies
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) == 4
    assert_same(tensors(tmp_path / "out"), original)


def test_keys_of_one_group_are_contiguous_in_write_order() -> None:
    state = RevertedState(build_moe_model(CFG, seed=0))
    order = list(state)
    for group in state.group_keys:
        start = order.index(group[0])
        assert tuple(order[start : start + len(group)]) == group


def test_unfused_experts_are_views_of_the_fused_parameter_not_copies() -> None:
    model = build_moe_model(CFG, seed=0)
    fused = model.model.layers[0].mlp.experts.gate_up_proj
    w3 = RevertedState(model)["model.layers.0.block_sparse_moe.experts.1.w3.weight"]
    assert w3.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert w3.is_contiguous() and torch.equal(w3, fused[1, CFG.intermediate_size :])


def test_reversed_mapping_that_is_not_one_to_one_is_refused() -> None:
    class TwoNames(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = types.SimpleNamespace(model_type="toy_two_names")
            self.x = nn.Parameter(torch.zeros(2))
            self.y = nn.Parameter(torch.zeros(2))

    with registry_snapshot():
        register_checkpoint_conversion_mapping(
            "toy_two_names", [surgery.WeightRenaming("^a$", "x"), surgery.WeightRenaming("^a$", "y")]
        )
        with pytest.raises(ConversionError, match="two tensors would be written as 'a'"):
            RevertedState(TwoNames())


def test_save_to_a_single_file_path(tmp_path: Path) -> None:
    model = build_moe_model(CFG, seed=0)
    files = surgery.save_checkpoint(model, tmp_path / "m.safetensors")
    assert files == [tmp_path / "m.safetensors"]
    assert not (tmp_path / SAFE_WEIGHTS_NAME).exists()
    assert_same(tensors(tmp_path / "m.safetensors"), original_state_dict(model))


@pytest.mark.parametrize("shard_size", [2_000, 5_000, 9_000, 20_000, 40_000])
def test_saving_with_the_source_shard_size_rewrites_the_same_shards(tmp_path: Path, shard_size: int) -> None:
    write_checkpoint(
        original_state_dict(build_moe_model(CFG, seed=0)), tmp_path / "src", max_shard_size=shard_size
    )
    model = build_moe_model(CFG, device="meta")
    assert surgery.load_checkpoint(model, tmp_path / "src").ok
    surgery.save_checkpoint(model, tmp_path / "out", max_shard_size=shard_size)
    assert same_files(tmp_path / "src", tmp_path / "out")


def test_runtime_layout_checkpoint_resaved_in_runtime_layout_keeps_its_shards(tmp_path: Path) -> None:
    write_checkpoint(build_moe_model(CFG, seed=0).state_dict(), tmp_path / "src", max_shard_size=9_000)
    model = build_moe_model(CFG, device="meta")
    assert surgery.load_checkpoint(model, tmp_path / "src").ok
    surgery.save_checkpoint(model, tmp_path / "out", original_format=False, max_shard_size=9_000)
    assert same_files(tmp_path / "src", tmp_path / "out")


def test_a_save_carries_the_source_checkpoints_config_files(tmp_path: Path) -> None:
    from surgery.examples.moe import ExampleMoEConfig, build_moe_model, original_state_dict

    cfg = ExampleMoEConfig()
    write_checkpoint(original_state_dict(build_moe_model(cfg, seed=0)), tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text('{"model_type": "mixtral"}')
    (tmp_path / "src" / "generation_config.json").write_text('{"max_new_tokens": 4}')
    model = build_moe_model(cfg, device="meta")
    surgery.load_checkpoint(model, tmp_path / "src")
    surgery.save_checkpoint(model, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_text() == '{"model_type": "mixtral"}'
    assert (tmp_path / "out" / "generation_config.json").read_text() == '{"max_new_tokens": 4}'
    (tmp_path / "out" / "config.json").write_text('{"mine": 1}')
    surgery.save_checkpoint(model, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_text() == '{"mine": 1}'  # an existing one is kept


# ------------------------------------------------------------ config.json describes what was written

HUB_CONFIG = {"model_type": "example_decoder", "dtype": "float32", "tie_word_embeddings": False}
"""The source checkpoint's config.json: a plain float model, as transformers writes one."""
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
FP8_BLOCK = (16, 16)


def _config_json(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _decoder_source(tmp_path: Path, *, fp8: dict | None = None) -> Path:
    """The example decoder's checkpoint with a config.json; ``fp8``: stored FP8 with that quantization_config."""
    from fp8_reference import quantize_state

    from surgery.examples.decoder import build_decoder_model

    src = tmp_path / "src"
    state = build_decoder_model(seed=0).state_dict()
    write_checkpoint(quantize_state(state, FP8_BLOCK) if fp8 is not None else state, src)
    config = dict(HUB_CONFIG)
    if fp8:
        config["quantization_config"] = fp8
    (src / "config.json").write_text(json.dumps(config))
    return src


def _decoder(seed: int = 1) -> nn.Module:
    from surgery.examples.decoder import build_decoder_model

    return build_decoder_model(seed=seed)


def test_a_gate_up_runtime_save_writes_no_fusion_config_and_a_refusal_for_transformers(
    tmp_path: Path,
) -> None:
    src = _decoder_source(tmp_path)
    fused = _decoder()
    surgery.apply_fusions(fused, {"gate_up": True})
    assert surgery.load_checkpoint(fused, src, strict=True).ok
    surgery.save_checkpoint(fused, tmp_path / "out", original_format=False)

    config = _config_json(tmp_path / "out")
    refusal = config.pop("transformers_weights")
    assert config == HUB_CONFIG  # no fusion_config transformers would reject ("Unknown fusion type")
    assert refusal.startswith(TRANSFORMERS_REFUSAL) and "gate_up" in refusal
    assert "original_format=True" in refusal and not refusal.endswith((".safetensors", ".index.json"))
    # Our loader still re-applies the fusion: it is persisted where transformers does not read.
    again = _decoder(seed=2)
    report = surgery.load_checkpoint(again, tmp_path / "out", strict=True)
    assert list(report.fusions or {}) == ["gate_up"]
    assert_same(again.state_dict(), fused.state_dict())


def test_a_checkpoint_saved_with_gate_up_in_its_config_json_by_the_old_code_still_loads_fused(
    tmp_path: Path,
) -> None:
    src = _decoder_source(tmp_path)
    fused = _decoder()
    surgery.apply_fusions(fused, {"gate_up": True})
    surgery.load_checkpoint(fused, src, strict=True)
    old = tmp_path / "old"  # what a runtime-layout save wrote before: the fusion in config.json only
    write_checkpoint(fused.state_dict(), old)
    (old / "config.json").write_text(json.dumps({**HUB_CONFIG, "fusion_config": {"gate_up": True}}))

    again = _decoder(seed=2)
    report = surgery.load_checkpoint(again, old, strict=True)
    assert report.fusions == {"gate_up": True}
    assert_same(again.state_dict(), fused.state_dict())


def test_a_patch_embeddings_runtime_save_keeps_the_fusion_transformers_performs_in_config_json(
    tmp_path: Path,
) -> None:
    tower = build_vision_tower(seed=0)
    write_checkpoint(tower.state_dict(), tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text(json.dumps(HUB_CONFIG))
    fused = build_vision_tower(seed=1)
    surgery.load_checkpoint(fused, tmp_path / "src", fusion_config=FUSE)
    surgery.save_checkpoint(fused, tmp_path / "out", original_format=False)
    assert _config_json(tmp_path / "out") == {**HUB_CONFIG, "fusion_config": FUSE}


def test_an_int8_runtime_save_writes_its_quantization_config_and_a_refusal_for_transformers(
    tmp_path: Path,
) -> None:
    from surgery.quantization import Int8WeightOnlyQuantizer

    src = _decoder_source(tmp_path)
    model = _decoder()
    assert surgery.load_checkpoint(model, src, quantizer=Int8WeightOnlyQuantizer(exclude=["lm_head"])).ok
    surgery.save_checkpoint(model, tmp_path / "out", original_format=False)

    config = _config_json(tmp_path / "out")
    assert config["quantization_config"] == {
        "quant_method": "int8_weight_only",
        "targets": None,
        "exclude": ["lm_head"],
    }
    assert config["transformers_weights"].startswith(TRANSFORMERS_REFUSAL)
    assert "'int8_weight_only'" in config["transformers_weights"]
    assert tensors(tmp_path / "out")["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8


def test_an_original_format_save_drops_what_a_runtime_layout_config_json_said(tmp_path: Path) -> None:
    from surgery.quantization import Int8WeightOnlyQuantizer

    src = _decoder_source(tmp_path)
    model = _decoder()
    surgery.apply_fusions(model, {"gate_up": True})
    surgery.load_checkpoint(model, src, quantizer=Int8WeightOnlyQuantizer(exclude=["lm_head"]))
    surgery.save_checkpoint(model, tmp_path / "runtime", original_format=False)
    assert {"quantization_config", "transformers_weights"} <= set(_config_json(tmp_path / "runtime"))

    again = _decoder(seed=2)
    assert surgery.load_checkpoint(
        again, tmp_path / "runtime", strict=True
    ).ok  # fusion and quantizer rebuilt
    surgery.save_checkpoint(again, tmp_path / "floats")  # original layout: dequantized floats, unfused
    assert _config_json(tmp_path / "floats") == HUB_CONFIG
    assert all(t.dtype == torch.float32 for t in tensors(tmp_path / "floats").values())


@pytest.mark.parametrize(
    ("save_kwargs", "written"),
    [
        ({}, FP8_CONFIG),
        ({"quantization": "dequantized"}, None),
        ({"original_format": False}, None),
    ],
    ids=["as_loaded-keeps-it", "dequantized-drops-it", "runtime-floats-drop-it"],
)
def test_an_fp8_models_config_json_has_a_quantization_config_exactly_when_fp8_tensors_are_written(
    tmp_path: Path, save_kwargs: dict, written: dict | None
) -> None:
    from surgery.quantization import FP8BlockQuantizer

    src = _decoder_source(tmp_path, fp8=FP8_CONFIG)
    model = _decoder()
    assert surgery.load_checkpoint(model, src, quantizer=FP8BlockQuantizer.from_config(src), strict=True).ok
    surgery.save_checkpoint(model, tmp_path / "out", **save_kwargs)

    config = _config_json(tmp_path / "out")
    assert config.get("quantization_config") == written and "transformers_weights" not in config
    stored = {t.dtype for t in tensors(tmp_path / "out").values()}
    assert (torch.float8_e4m3fn in stored) == (written is not None)
    if written is not None:  # the source's config.json comes back as it was
        assert (tmp_path / "out" / "config.json").read_text() == (src / "config.json").read_text()


def test_an_fp8_save_into_a_config_without_quantization_config_writes_one_that_loads_it_back(
    tmp_path: Path,
) -> None:
    from surgery.quantization import FP8BlockQuantizer

    src = _decoder_source(tmp_path, fp8={})  # stored FP8, but config.json does not say so
    model = _decoder()
    assert surgery.load_checkpoint(model, src, quantizer=FP8BlockQuantizer(block_size=FP8_BLOCK)).ok
    surgery.save_checkpoint(model, tmp_path / "out")

    written = _config_json(tmp_path / "out")["quantization_config"]
    assert written == {**FP8_CONFIG, "modules_to_not_convert": ["lm_head", "model.embed_tokens"]}
    again = _decoder(seed=2)
    quantizer = FP8BlockQuantizer.from_config(tmp_path / "out")
    assert surgery.load_checkpoint(again, tmp_path / "out", quantizer=quantizer, strict=True).ok
    assert_same(again.state_dict(), model.state_dict())


def test_a_quantizer_whose_quantization_config_is_not_json_fails_the_save_before_anything_is_written(
    tmp_path: Path,
) -> None:
    from surgery.quantization import Int8WeightOnlyQuantizer

    class Unwritable(Int8WeightOnlyQuantizer):
        def quantization_config(self) -> dict:
            return {"quant_method": "int8_weight_only", "scale": torch.ones(1)}

    src = _decoder_source(tmp_path)
    model = _decoder()
    surgery.load_checkpoint(model, src, quantizer=Unwritable())
    with pytest.raises(ConfigurationError, match=r"Unwritable\.quantization_config\(\).*not JSON"):
        surgery.save_checkpoint(model, tmp_path / "out", original_format=False)
    assert not (tmp_path / "out").exists()


def test_the_refusal_for_transformers_names_the_save_option_that_writes_what_it_reads() -> None:
    from surgery.saved_config import saved_config

    e5m2 = {"quant_method": "fp8", "fmt": "e5m2"}
    refusals = {
        "fused runtime layout": saved_config(fusions={"qkv": True, "gate_up": False}).refusal(),
        "e5m2 as loaded": saved_config(fusions=None, quantization=e5m2, original_format=True).refusal(),
    }
    assert (
        "the fusions qkv," in refusals["fused runtime layout"]
        and "gate_up" not in refusals["fused runtime layout"]
    )
    assert "original_format=True" in refusals["fused runtime layout"]
    assert "quant_method 'fp8'" in refusals["e5m2 as loaded"]
    assert "quantization='dequantized'" in refusals["e5m2 as loaded"]
    transformers_reads = saved_config(
        fusions={"patch_embeddings": True},
        quantization=e5m2 | {"fmt": "e4m3"},
        quantization_loads_in_transformers=True,
        original_format=True,
    )
    assert transformers_reads.refusal() is None and transformers_reads.fusion_config == FUSE


def test_a_quantization_config_in_a_sub_config_follows_the_tensors_too() -> None:
    from surgery.saved_config import SavedConfig, rewrite_config

    fp8 = {**FP8_CONFIG, "modules_to_not_convert": ["lm_head"]}
    source = {"model_type": "vlm", "text_config": {"hidden_size": 8, "quantization_config": fp8}}
    assert rewrite_config(source, SavedConfig()) == {"model_type": "vlm", "text_config": {"hidden_size": 8}}
    kept = rewrite_config(source, SavedConfig(quantization_config=FP8_CONFIG, unquantized_modules=()))
    assert kept == {"model_type": "vlm", "text_config": {"hidden_size": 8}, "quantization_config": fp8}


# --------------------------------------------------------------------------- overlapping reversed converters


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.arange(24.0).reshape(2, 3, 4))


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _Experts()


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = _Mixer()


class PrecedenceInner(nn.Module):
    """A sub-model with a mapping of its own (its own checkpoints hold one tensor per expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer()])


class PrecedenceOuter(nn.Module):
    """A whole model whose mapping stores the same parameter fused and transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = PrecedenceInner()


@pytest.fixture
def precedence_mappings():
    with registry_snapshot():
        register_checkpoint_conversion_mapping(
            "PrecedenceOuter",
            [WeightConverter(r"mixer\.experts\.fused", "mixer.experts.up_proj", [ops.Transpose(1, 2)])],
        )
        register_checkpoint_conversion_mapping(
            "PrecedenceInner",
            [
                WeightConverter(
                    "mixer.experts.*.up_proj.weight", "mixer.experts.up_proj", [ops.MergeModulelist(0)]
                )
            ],
        )
        yield


def test_a_model_never_loaded_saves_the_whole_models_layout_where_a_sub_models_converter_also_claims_the_key(
    precedence_mappings,
) -> None:
    saved = surgery.revert_state_dict(PrecedenceOuter())
    assert list(saved) == ["lm.layers.0.mixer.experts.fused"]
    assert torch.equal(
        saved["lm.layers.0.mixer.experts.fused"], torch.arange(24.0).reshape(2, 3, 4).transpose(1, 2)
    )


def test_the_converter_that_fired_at_load_wins_the_save_over_the_whole_models(
    precedence_mappings, tmp_path
) -> None:
    experts = {f"lm.layers.0.mixer.experts.{i}.up_proj.weight": torch.randn(3, 4) for i in range(2)}
    write_checkpoint(experts, tmp_path / "in")
    model = PrecedenceOuter()
    report = surgery.load_checkpoint(model, tmp_path / "in", strict=True)
    assert not report.missing_keys
    assert_same(surgery.revert_state_dict(model), experts)
