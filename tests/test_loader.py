"""Loading: bad input, the report, meta materialization, zero copy, ties, threads, dtype/device, Ctrl-C."""

from __future__ import annotations

import json
import struct
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from torch import nn

import surgery
from surgery import WeightConverter, ops
from surgery.checkpoint import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, write_checkpoint
from surgery.errors import CheckpointError, ConfigurationError, LoadError
from surgery.examples.moe import ExampleMoEConfig, build_moe_model, original_state_dict
from surgery.load.loader import SYNC_ENV
from surgery.persist import FUSION_METADATA_KEY
from surgery.record import record_of
from surgery.registry import register_checkpoint_conversion_mapping, registry_snapshot

if TYPE_CHECKING:
    from conftest import WriteOriginal

CFG = ExampleMoEConfig()
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


def reference(dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return build_moe_model(CFG, seed=0, dtype=dtype).state_dict()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------ bad input


def test_truncated_file_is_refused_before_the_model_changes(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path)
    file = tmp_path / SAFE_WEIGHTS_NAME
    file.write_bytes(file.read_bytes()[:-100])
    model = build_moe_model(CFG, seed=3)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=r"file has only \d+ bytes"):
        surgery.load_checkpoint(model, tmp_path)
    assert_same(model.state_dict(), before)
    assert record_of(model).load is None


def test_wrong_header_is_refused_naming_the_file(tmp_path: Path, write_original: WriteOriginal) -> None:
    write_original(tmp_path)
    file = tmp_path / SAFE_WEIGHTS_NAME
    data = bytearray(file.read_bytes())
    data[:8] = struct.pack("<Q", 2**40)
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*header claims"):
        surgery.load_checkpoint(build_moe_model(CFG), tmp_path)


def test_header_that_is_not_json_is_refused(tmp_path: Path, write_original: WriteOriginal) -> None:
    write_original(tmp_path)
    file = tmp_path / SAFE_WEIGHTS_NAME
    data = bytearray(file.read_bytes())
    data[8:12] = b"nope"
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not valid JSON"):
        surgery.plan_load(build_moe_model(CFG), tmp_path)


def _sharded(path: Path) -> list[str]:
    """The example checkpoint in three or more shards; returns the shard file names."""
    sd = original_state_dict(build_moe_model(CFG, seed=0))
    files = write_checkpoint(sd, path, max_shard_size=sum(t.nbytes for t in sd.values()) // 3)
    return [f.name for f in files if f.suffix == ".safetensors"]


def test_missing_shard_is_refused_naming_the_shard(tmp_path: Path) -> None:
    shard = _sharded(tmp_path)[1]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"{shard}.*does not exist"):
        surgery.load_checkpoint(build_moe_model(CFG), tmp_path)


def test_index_pointing_outside_the_directory_is_refused(tmp_path: Path) -> None:
    first = _sharded(tmp_path / "ckpt")[0]
    index = tmp_path / "ckpt" / SAFE_WEIGHTS_INDEX_NAME
    data = json.loads(index.read_text())
    key = next(iter(data["weight_map"]))
    data["weight_map"][key] = f"../{first}"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="escapes the checkpoint directory"):
        surgery.load_checkpoint(build_moe_model(CFG), tmp_path / "ckpt")


def test_shape_mismatch_is_reported_and_not_loaded(tmp_path: Path, write_original: WriteOriginal) -> None:
    write_original(tmp_path, model__norm__weight=torch.ones(CFG.hidden_size + 1))
    model = build_moe_model(CFG, seed=3)
    before = model.model.norm.weight.detach().clone()
    report = surgery.load_checkpoint(model, tmp_path)
    (m,) = report.mismatched
    assert (m.key, m.kind, m.loaded, m.source_keys) == (
        "model.norm.weight",
        "shape",
        False,
        ("model.norm.weight",),
    )
    assert (m.checkpoint, m.model) == ("(17,)", "(16,)")
    assert torch.equal(model.model.norm.weight, before)
    assert "model.norm.weight" not in report.loaded_keys + report.missing_keys
    assert not report.ok
    assert len(report.loaded_keys) == len(reference()) - 1


def test_shape_mismatch_of_a_converter_output_is_reported_with_its_sources(tmp_path: Path) -> None:
    # one layer's experts come from a model with a smaller intermediate size
    small = original_state_dict(build_moe_model(ExampleMoEConfig(intermediate_size=8), seed=0))
    sd = original_state_dict(build_moe_model(CFG, seed=0))
    for k in sd:
        if k.startswith("model.layers.0.block_sparse_moe.experts."):
            sd[k] = small[k]
    write_checkpoint(sd, tmp_path)
    report = surgery.load_checkpoint(build_moe_model(CFG), tmp_path)
    by_key = {m.key: m for m in report.mismatched}
    assert set(by_key) == {GATE_UP, "model.layers.0.mlp.experts.down_proj"}
    assert by_key[GATE_UP].checkpoint == "(4, 16, 16)"
    assert len(by_key[GATE_UP].source_keys) == 2 * CFG.num_local_experts
    assert "model.layers.1.mlp.experts.gate_up_proj" in report.loaded_keys


def test_dtype_mismatch_is_reported_and_loaded_with_a_cast(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path, dtype=torch.bfloat16)
    model = build_moe_model(CFG, seed=3)
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.ok  # a cast is not a failure
    assert {m.kind for m in report.mismatched} == {"dtype"}
    assert all(m.loaded and m.checkpoint == "bfloat16" and m.model == "float32" for m in report.mismatched)
    assert {m.key for m in report.mismatched} == set(reference())
    want = {k: v.float() for k, v in reference(torch.bfloat16).items()}
    assert_same(model.state_dict(), want)


@dataclass(frozen=True)
class Explode(ops.ConversionOp):
    """A user op that fails: on real data only (``on_meta=False``) or already while planning."""

    on_meta: bool = False
    failure: type[BaseException] = ValueError

    def convert(self, slots, ctx):
        (t,) = slots
        if self.on_meta or t.device.type != "meta":
            raise self.failure("boom")
        return [t.clone()]

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return Explode(self.on_meta, self.failure)


class Toy(nn.Module):
    """Two parameters; ``config.model_type`` picks the mapping the test registers."""

    def __init__(self, model_type: str, n: int = 2, device: str | None = None) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(model_type=model_type)
        self.w = nn.ParameterList(nn.Parameter(torch.zeros(3, device=device)) for _ in range(n))
        self.other = nn.Parameter(torch.zeros(2, device=device))


@pytest.fixture
def registry():
    with registry_snapshot():
        yield


@pytest.mark.parametrize("on_meta", [False, True], ids=["fails-while-loading", "fails-while-planning"])
def test_failing_converter_is_reported_and_other_keys_still_load(
    tmp_path: Path, registry, on_meta: bool
) -> None:
    register_checkpoint_conversion_mapping(
        "toy_explode", [WeightConverter(r"^v\.1$", "w.1", [Explode(on_meta=on_meta)])]
    )
    write_checkpoint({"v.1": torch.ones(3), "w.0": torch.full((3,), 2.0), "other": torch.ones(2)}, tmp_path)
    model = Toy("toy_explode")
    report = surgery.load_checkpoint(model, tmp_path)
    (err,) = report.conversion_errors
    assert "Explode" in err.transform and "WeightConverter" in err.transform
    assert (err.source_keys, err.target_keys) == (("v.1",), ("w.1",))
    assert "boom" in err.message
    assert report.loaded_keys == ["other", "w.0"]  # the model's order
    assert report.missing_keys == []  # the failed target is reported once, as a conversion error
    assert torch.equal(model.w[0], torch.full((3,), 2.0)) and torch.equal(model.w[1], torch.zeros(3))
    assert not report.ok


def test_two_keys_landing_on_one_parameter_are_a_conflict_and_neither_is_loaded(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    # the renaming block_sparse_moe -> mlp makes both keys name model.layers.0.mlp.gate.weight
    gate = torch.full((CFG.num_local_experts, CFG.hidden_size), 7.0)
    write_original(tmp_path, model__layers__0__mlp__gate__weight=gate)
    model = build_moe_model(CFG, seed=3)
    before = model.model.layers[0].mlp.gate.weight.detach().clone()
    report = surgery.load_checkpoint(model, tmp_path)
    (c,) = report.conflicts
    assert set(c.source_keys) == {
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.mlp.gate.weight",
    }
    assert c.target_keys == ("model.layers.0.mlp.gate.weight",)
    assert torch.equal(model.model.layers[0].mlp.gate.weight, before)
    assert "model.layers.0.mlp.gate.weight" not in report.loaded_keys + report.missing_keys
    assert "model.layers.1.mlp.gate.weight" in report.loaded_keys
    assert not report.ok
    (entry,) = [e for e in report.plan.entries if e.status == "conflict"]
    assert entry.mode == "skip"


def test_strict_load_raises_load_error_carrying_the_report(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path, model__norm__weight=None)
    with pytest.raises(LoadError, match=r"model\.norm\.weight") as info:
        surgery.load_checkpoint(build_moe_model(CFG), tmp_path, strict=True)
    assert info.value.report.missing_keys == ["model.norm.weight"]


def test_strict_load_refuses_what_the_headers_show_before_touching_the_model(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path, model__norm__weight=None, extra__weight=torch.ones(2))
    model = build_moe_model(CFG, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoadError, match="before setting any parameter") as info:
        surgery.load_checkpoint(model, tmp_path, strict=True)
    report = info.value.report
    assert report.missing_keys == ["model.norm.weight"] and report.unexpected_keys == ["extra.weight"]
    assert report.loaded_keys == []
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing was loaded


def test_strict_load_of_a_complete_checkpoint_returns_the_report(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path)
    assert surgery.load_checkpoint(build_moe_model(CFG), tmp_path, strict=True).ok


# ------------------------------------------------------------------------------------------ materialization


def test_model_built_on_meta_is_materialized_from_the_checkpoint(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path)
    model = build_moe_model(CFG, device="meta")
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.ok
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    assert_same(model.state_dict(), reference())
    ids = torch.randint(0, CFG.vocab_size, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(ids), build_moe_model(CFG, seed=0)(ids))


def test_meta_model_takes_plain_tensors_zero_copy_and_experts_read_into_place(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path)
    report = surgery.load_checkpoint(build_moe_model(CFG, device="meta"), tmp_path)
    modes = {k: e.mode for e in report.plan.entries for k in e.target_keys}
    experts = {k for k in modes if ".experts." in k}
    assert {modes[k] for k in experts} == {"direct"}
    assert set(report.mapped_keys) == set(modes) - experts
    assert {modes[k] for k in report.mapped_keys} == {"mmap"}


def test_runtime_layout_checkpoint_into_meta_model_is_mapped_without_a_copy(tmp_path: Path) -> None:
    write_checkpoint(reference(), tmp_path)
    model = build_moe_model(CFG, device="meta")
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.mapped_keys == list(reference()) == report.loaded_keys
    assert_same(model.state_dict(), reference())


def test_writing_to_a_mapped_parameter_never_touches_the_file(tmp_path: Path) -> None:
    write_checkpoint(reference(), tmp_path)
    before = (tmp_path / SAFE_WEIGHTS_NAME).read_bytes()
    model = build_moe_model(CFG, device="meta")
    surgery.load_checkpoint(model, tmp_path)
    with torch.no_grad():
        model.model.norm.weight.fill_(5.0)
    assert (tmp_path / SAFE_WEIGHTS_NAME).read_bytes() == before


def _overwrite_in_place(path: Path, key: str, value: float) -> None:
    """Rewrite ``key``'s bytes in the file without replacing the file (same inode)."""
    from surgery.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        info = reader.info(key)
    data = torch.full(info.shape, value, dtype=info.dtype).numpy().tobytes()
    with open(path / SAFE_WEIGHTS_NAME, "r+b") as f:
        f.seek(info.offset)
        f.write(data)


def test_a_mapped_parameter_follows_later_in_place_writes_to_the_file(tmp_path: Path) -> None:
    """The documented hazard of the mmap mode: untouched pages still read the file."""
    write_checkpoint(reference(), tmp_path)
    model = build_moe_model(CFG, device="meta")
    surgery.load_checkpoint(model, tmp_path)
    _overwrite_in_place(tmp_path, "lm_head.weight", 7.0)
    assert torch.all(model.lm_head.weight == 7.0)


def test_mmap_false_reads_into_owned_memory_that_later_writes_do_not_reach(tmp_path: Path) -> None:
    write_checkpoint(reference(), tmp_path)
    model = build_moe_model(CFG, device="meta")
    plan = surgery.plan_load(model, tmp_path, mmap=False)
    assert {e.mode for e in plan.entries} == {"direct"}
    report = surgery.load_checkpoint(model, tmp_path, mmap=False)
    assert report.ok and report.mapped_keys == []
    _overwrite_in_place(tmp_path, "lm_head.weight", 7.0)
    assert_same(model.state_dict(), reference())


def test_cpu_model_is_filled_in_place(tmp_path: Path, write_original: WriteOriginal) -> None:
    write_original(tmp_path)
    model = build_moe_model(CFG, seed=3)
    params = {k: p for k, p in model.named_parameters()}
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.mapped_keys == []
    assert all(p is params[k] for k, p in model.named_parameters())
    assert_same(model.state_dict(), reference())


def test_missing_parameters_are_reported(tmp_path: Path, write_original: WriteOriginal) -> None:
    write_original(tmp_path, model__norm__weight=None, lm_head__weight=None)
    report = surgery.load_checkpoint(build_moe_model(CFG), tmp_path)
    assert report.missing_keys == ["model.norm.weight", "lm_head.weight"]
    assert not report.ok
    assert "missing keys" in str(report)


def test_missing_parameters_of_a_meta_model_stay_on_meta_never_random(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path, model__norm__weight=None)
    model = build_moe_model(CFG, device="meta")
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.missing_keys == ["model.norm.weight"]
    assert model.model.norm.weight.device.type == "meta"


# ------------------------------------------------------------------------------------------ tied weights


class TiedLM(nn.Module):
    """``lm_head.weight`` is ``embed_tokens.weight``."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(8, 4, device=device)
        self.norm = nn.LayerNorm(4, device=device)
        self.lm_head = nn.Linear(4, 8, bias=False, device=device)
        self.lm_head.weight = self.embed_tokens.weight


def tied_checkpoint(path: Path, name: str) -> torch.Tensor:
    weight = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    write_checkpoint({name: weight, "norm.weight": torch.ones(4), "norm.bias": torch.zeros(4)}, path)
    return weight


@pytest.mark.parametrize("name", ["embed_tokens.weight", "lm_head.weight"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_one_name_of_a_tied_parameter_loads_both_and_keeps_them_tied(
    tmp_path: Path, name: str, device: str
) -> None:
    weight = tied_checkpoint(tmp_path, name)
    model = TiedLM(device)
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.ok and report.missing_keys == []
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, weight)


def test_both_names_of_a_tied_parameter_are_a_conflict(tmp_path: Path) -> None:
    sd = {"embed_tokens.weight": torch.ones(8, 4), "lm_head.weight": torch.zeros(8, 4)}
    write_checkpoint({**sd, "norm.weight": torch.ones(4), "norm.bias": torch.zeros(4)}, tmp_path)
    model = TiedLM()
    report = surgery.load_checkpoint(model, tmp_path)
    (c,) = report.conflicts
    assert set(c.source_keys) == set(sd) and set(c.target_keys) == set(sd)
    assert report.loaded_keys == ["norm.weight", "norm.bias"]
    assert model.lm_head.weight is model.embed_tokens.weight


# ------------------------------------------------------------------------------------------ threads, dtype, device


def _load_everything(path: Path, **kwargs) -> tuple[dict, dict]:
    model = build_moe_model(CFG, seed=3)
    report = surgery.load_checkpoint(model, path, **kwargs)
    d = report.to_dict()
    d.pop("seconds")
    return snapshot(model), d


@pytest.mark.parametrize("how", ["env", "argument"])
def test_sequential_loading_gives_what_threads_give(
    tmp_path: Path, monkeypatch, how: str, write_original: WriteOriginal
) -> None:
    write_original(tmp_path, dtype=torch.bfloat16, model__norm__weight=torch.ones(3), lm_head__weight=None)
    threaded_state, threaded_report = _load_everything(tmp_path, num_workers=4)
    if how == "env":
        monkeypatch.setenv(SYNC_ENV, "1")
        sync_state, sync_report = _load_everything(tmp_path)
    else:
        sync_state, sync_report = _load_everything(tmp_path, sync=True)
    assert_same(sync_state, threaded_state)
    assert sync_report == threaded_report


def test_dtype_argument_casts_floating_tensors_without_reporting_a_mismatch(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path)
    model = build_moe_model(CFG, device="meta")
    report = surgery.load_checkpoint(model, tmp_path, dtype=torch.bfloat16)
    assert report.ok and report.mismatched == []
    assert_same(model.state_dict(), reference(torch.bfloat16))


def test_dtype_argument_accepts_the_dtype_name(tmp_path: Path, write_original: WriteOriginal) -> None:
    write_original(tmp_path)
    model = build_moe_model(CFG, seed=3)
    surgery.load_checkpoint(model, tmp_path, dtype="bfloat16")
    assert {t.dtype for t in model.state_dict().values()} == {torch.bfloat16}


def test_dtype_checkpoint_keeps_each_checkpoint_dtype(tmp_path: Path, write_original: WriteOriginal) -> None:
    write_original(tmp_path, dtype=torch.bfloat16)
    model = build_moe_model(CFG, seed=3)
    report = surgery.load_checkpoint(model, tmp_path, dtype="checkpoint")
    assert report.ok and report.mismatched == []
    assert_same(model.state_dict(), reference(torch.bfloat16))


def test_unknown_dtype_is_a_configuration_error_naming_the_choices(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path)
    with pytest.raises(ConfigurationError, match="'checkpoint'"):
        surgery.load_checkpoint(build_moe_model(CFG), tmp_path, dtype="float99")


def test_device_argument_places_a_meta_model(tmp_path: Path, write_original: WriteOriginal) -> None:
    write_original(tmp_path)
    model = build_moe_model(CFG, device="meta")
    report = surgery.load_checkpoint(model, tmp_path, device="cpu")
    assert {e.device for e in report.plan.entries} == {"cpu"}
    assert {t.device.type for t in model.state_dict().values()} == {"cpu"}


def test_bad_device_is_a_configuration_error(tmp_path: Path, write_original: WriteOriginal) -> None:
    write_original(tmp_path)
    with pytest.raises(ConfigurationError, match="not a torch device"):
        surgery.load_checkpoint(build_moe_model(CFG), tmp_path, device="gpu:nine")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_argument_moves_loaded_tensors_to_the_accelerator(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path)
    model = build_moe_model(CFG, device="meta")
    assert surgery.load_checkpoint(model, tmp_path, device="cuda").ok
    assert {t.device.type for t in model.state_dict().values()} == {"cuda"}
    assert_same({k: v.cpu() for k, v in model.state_dict().items()}, reference())


# ------------------------------------------------------------------------------------------ interrupts, progress


@dataclass(frozen=True)
class CountingInterrupt(ops.ConversionOp):
    """Counts real conversions and raises KeyboardInterrupt on the first one."""

    calls: list

    def convert(self, slots, ctx):
        (t,) = slots
        if t.device.type != "meta":
            self.calls.append(1)
            raise KeyboardInterrupt
        return [t]

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return self

    def __hash__(self) -> int:
        return id(self)


@pytest.mark.parametrize("sync", [False, True], ids=["threads", "sequential"])
def test_keyboard_interrupt_propagates_cancels_pending_work_and_leaves_no_record(
    tmp_path: Path, registry, sync: bool
) -> None:
    n = 40
    calls: list = []
    register_checkpoint_conversion_mapping(
        "toy_ctrl_c", [WeightConverter(r"^v\.(\d+)$", r"w.\1", [CountingInterrupt(calls)])]
    )
    write_checkpoint(
        {"other": torch.ones(2), **{f"w.{i}": torch.ones(3) for i in range(n)}}, tmp_path / "good"
    )
    write_checkpoint({f"v.{i}": torch.ones(3) for i in range(n)}, tmp_path / "bad")
    model = Toy("toy_ctrl_c", n)
    assert surgery.load_checkpoint(model, tmp_path / "good").ok
    assert record_of(model).load is not None
    with pytest.raises(KeyboardInterrupt):
        surgery.load_checkpoint(model, tmp_path / "bad", sync=sync, num_workers=2)
    assert record_of(model).load is None
    assert 1 <= len(calls) < n // 2  # the rest was cancelled before it started


def test_progress_bar_is_silent_when_stderr_is_not_a_terminal(
    tmp_path: Path, capsys, write_original: WriteOriginal
) -> None:
    write_original(tmp_path)
    surgery.load_checkpoint(build_moe_model(CFG), tmp_path)
    assert capsys.readouterr().err == ""


def test_progress_bar_can_be_forced_on(tmp_path: Path, capsys, write_original: WriteOriginal) -> None:
    write_original(tmp_path)
    surgery.load_checkpoint(build_moe_model(CFG), tmp_path, progress=True)
    assert "100.0%" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ report


def test_report_lists_the_transforms_that_fired(tmp_path: Path, write_original: WriteOriginal) -> None:
    write_original(tmp_path)
    report = surgery.load_checkpoint(build_moe_model(CFG), tmp_path)
    assert len(report.transforms_used) == 3
    assert report.transforms_used[0].startswith(r"WeightRenaming('\\.block_sparse_moe\\.'")
    assert all("MergeModulelist" in t for t in report.transforms_used[1:])


def test_report_round_trips_through_json_and_reads_well(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path, model__norm__weight=torch.ones(3), lm_head__weight=None, extra=torch.ones(1))
    report = surgery.load_checkpoint(build_moe_model(CFG), tmp_path)
    data = json.loads(report.to_json())
    assert data == report.to_dict()
    assert data["ok"] is False
    assert surgery.LoadReport.from_json(report.to_json()) == report
    text = str(report)
    assert text.startswith(f"LoadReport({tmp_path}): PROBLEMS")
    for fragment in ("lm_head.weight", "extra", "model.norm.weight: checkpoint shape (3,) vs model (16,)"):
        assert fragment in text


@pytest.mark.parametrize(
    ("env", "sync", "sequential"),
    [("1", None, True), ("yes", None, True), ("0", None, False), (None, None, False), ("1", False, False)],
)
def test_sync_switch_reads_the_environment_unless_the_argument_decides(
    monkeypatch, env, sync, sequential
) -> None:
    from surgery.load.loader import _sync_requested

    if env is None:
        monkeypatch.delenv(SYNC_ENV, raising=False)
    else:
        monkeypatch.setenv(SYNC_ENV, env)
    assert _sync_requested(sync) is sequential


# ------------------------------------------------------------------------------------------ batched reads


class Stacked(nn.Module):
    """One fused parameter filled from ``experts.{0..n-1}.w`` (``MergeModulelist``)."""

    def __init__(self, model_type: str, n: int, device: str | None = None) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(model_type=model_type)
        self.fused = nn.Parameter(torch.zeros(n, 2, 3, device=device))


@pytest.mark.parametrize("on_meta", [False, True], ids=["allocated", "meta"])
def test_experts_stored_back_to_back_fill_the_fused_parameter_exactly(
    tmp_path: Path, registry, on_meta: bool
) -> None:
    # Nine experts sort the same as text and as numbers, so the file holds them back to back in
    # the fused order: the loader reads them as one run.
    register_checkpoint_conversion_mapping(
        "toy_stacked", [WeightConverter("experts.*.w", "fused", [ops.MergeModulelist()])]
    )
    experts = {f"experts.{i}.w": torch.arange(6.0).reshape(2, 3) + 10 * i for i in range(9)}
    write_checkpoint(experts, tmp_path)
    model = Stacked("toy_stacked", 9, device="meta" if on_meta else None)
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.ok and [e.mode for e in report.plan.entries] == ["direct"]
    assert torch.equal(model.fused, torch.stack([experts[f"experts.{i}.w"] for i in range(9)]))


def test_experts_stored_out_of_order_fill_the_fused_parameter_exactly(tmp_path: Path, registry) -> None:
    # Twelve experts sort as text (0, 1, 10, 11, 2, ...): the runs break wherever the orders differ.
    register_checkpoint_conversion_mapping(
        "toy_stacked", [WeightConverter("experts.*.w", "fused", [ops.MergeModulelist()])]
    )
    experts = {f"experts.{i}.w": torch.full((2, 3), float(i)) for i in range(12)}
    write_checkpoint(experts, tmp_path)
    model = Stacked("toy_stacked", 12)
    assert surgery.load_checkpoint(model, tmp_path).ok
    assert torch.equal(model.fused, torch.stack([experts[f"experts.{i}.w"] for i in range(12)]))


def test_fusion_metadata_nested_too_deeply_is_a_load_error(tmp_path: Path) -> None:
    deep = "[" * 200_000 + "]" * 200_000
    write_checkpoint(nn.Linear(2, 2).state_dict(), tmp_path, metadata={FUSION_METADATA_KEY: deep})
    with pytest.raises(LoadError, match="not valid JSON"):
        surgery.load_checkpoint(nn.Linear(2, 2), tmp_path)


# --------------------------------------------------------------------------- lossy casts


@pytest.mark.parametrize(
    ("stored", "model_dtype", "lossy"),
    [
        (torch.float32, torch.bfloat16, True),
        (torch.float32, torch.float16, True),
        (torch.bfloat16, torch.float16, True),
        (torch.bfloat16, torch.float32, False),
        (torch.float16, torch.float32, False),
    ],
)
def test_a_narrowing_cast_nobody_asked_for_is_reported_lossy_and_fails_ok(
    tmp_path, stored, model_dtype, lossy
) -> None:
    write_checkpoint(
        {"weight": torch.randn(4, 4).to(stored), "bias": torch.zeros(4, dtype=model_dtype)}, tmp_path
    )
    model = nn.Linear(4, 4, dtype=model_dtype)
    report = surgery.load_checkpoint(model, tmp_path)
    (m,) = report.mismatched
    assert (m.key, m.kind, m.loaded, m.lossy) == ("weight", "dtype", True, lossy)
    assert report.ok is (not lossy)
    assert ("lossy cast" in str(report)) is lossy


def test_a_strict_load_refuses_a_lossy_cast_before_reading_and_dtype_asks_for_it(tmp_path) -> None:
    write_checkpoint({"weight": torch.randn(4, 4), "bias": torch.zeros(4)}, tmp_path)
    model = nn.Linear(4, 4, dtype=torch.bfloat16)
    before = model.weight.detach().clone()
    with pytest.raises(surgery.LoadError, match="lossy cast"):
        surgery.load_checkpoint(model, tmp_path, strict=True)
    assert torch.equal(model.weight, before)
    report = surgery.load_checkpoint(model, tmp_path, dtype=torch.bfloat16, strict=True)  # asked for: fine
    assert report.ok and report.mismatched == []


# ------------------------------------------------------------------------------------------ device="meta"


@pytest.mark.parametrize("device", ["meta", torch.device("meta")], ids=["str", "torch.device"])
def test_device_meta_is_refused_by_load_and_plan_naming_the_dry_run_and_the_model_is_untouched(
    tmp_path: Path, write_original: WriteOriginal, device: str | torch.device
) -> None:
    write_original(tmp_path)
    model = build_moe_model(CFG, device="meta")
    assert surgery.load_checkpoint(model, tmp_path).ok
    before, record = snapshot(model), record_of(model).load

    for call in (surgery.load_checkpoint, surgery.plan_load):
        with pytest.raises(ConfigurationError, match=rf"{call.__name__}\(\.\.\., device=.*plan_load") as info:
            call(model, tmp_path, device=device)
        assert "holds no data" in str(info.value)
    assert_same(model.state_dict(), before)
    assert record_of(model).load is record  # not even the record of the previous load is dropped


def test_a_model_built_on_meta_still_loads_to_cpu_by_default(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path)
    model = build_moe_model(CFG, device="meta")
    assert surgery.plan_load(model, tmp_path).entries[0].device == "cpu"
    assert surgery.load_checkpoint(model, tmp_path).ok
    assert {t.device.type for t in model.state_dict().values()} == {"cpu"}
