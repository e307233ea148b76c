"""Specification of the conversion ops: what each one does, its errors, and its exact inverse."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from surgery import ops
from surgery.errors import ConversionError, SurgeryError
from surgery.ops import OpContext

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]
_BITS = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.int8: torch.int8,
}


def _ctx(n_targets: int = 1, **kwargs) -> OpContext:
    return OpContext(n_targets=n_targets, **kwargs)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.dtype])


def _same_bits(a, b) -> bool:
    """Bit-for-bit equality of tensors or (nested) lists of tensors; NaN payloads included."""
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_same_bits, a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# --------------------------------------------------------------------------- Chunk / Split / Concatenate


def test_chunk_splits_into_one_equal_part_per_target():
    t = torch.arange(12).reshape(6, 2)
    parts = ops.Chunk(dim=0).convert([t], _ctx(3))
    assert [p.tolist() for p in parts] == [t[0:2].tolist(), t[2:4].tolist(), t[4:6].tolist()]


def test_chunk_refuses_a_dim_it_cannot_divide_evenly():
    # Grouped-query q/k/v of 4/2/2 heads (head_dim 1) fused to 8 rows: an equal split would give 3/3/2.
    with pytest.raises(ConversionError, match=r"cannot split dim 0 of size 8 .* into 3 equal parts.*Split"):
        ops.Chunk(dim=0).convert([torch.zeros(8, 4)], _ctx(3))


def test_split_takes_explicit_unequal_sizes_for_grouped_query_qkv():
    qkv = torch.arange(8 * 2).reshape(8, 2)
    q, k, v = ops.Split(sizes=(4, 2, 2), dim=0).convert([qkv], _ctx(3))
    assert (q.shape[0], k.shape[0], v.shape[0]) == (4, 2, 2)
    assert torch.equal(torch.cat([q, k, v]), qkv)


def test_split_without_sizes_reads_the_target_shapes():
    qkv = torch.randn(8, 3)
    parts = ops.Split(dim=0).convert([qkv], _ctx(3, target_shapes=((4, 3), (2, 3), (2, 3))))
    assert [tuple(p.shape) for p in parts] == [(4, 3), (2, 3), (2, 3)]


def test_split_sizes_that_do_not_add_up_name_the_shape():
    with pytest.raises(ConversionError, match=r"sizes \[4, 2, 1\] add up to 7 .* \(8, 3\)"):
        ops.Split(sizes=(4, 2, 1)).convert([torch.zeros(8, 3)], _ctx(3))


def test_concatenate_joins_slots_in_source_order():
    a, b = torch.zeros(2, 3), torch.ones(1, 3)
    (out,) = ops.Concatenate(dim=0).convert([a, b], _ctx())
    assert out.tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1]]


def test_concatenate_shape_mismatch_names_the_shapes_and_keys():
    ctx = _ctx(source_keys=("l.q.weight", "l.k.weight"), target_keys=("l.qkv.weight",))
    with pytest.raises(ConversionError) as info:
        ops.Concatenate(dim=0).convert([torch.zeros(2, 3), torch.zeros(2, 4)], ctx)
    message = str(info.value)
    assert "(2, 3)" in message and "(2, 4)" in message
    assert "l.q.weight" in message and "l.qkv.weight" in message


def test_concatenate_dtype_mismatch_is_refused():
    with pytest.raises(ConversionError, match="dtype"):
        ops.Concatenate(dim=0).convert([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16)], _ctx())


def test_concatenate_refuses_an_unmerged_list():
    with pytest.raises(ConversionError, match="MergeModulelist"):
        ops.Concatenate(dim=0).convert([[torch.zeros(2)], torch.zeros(2)], _ctx())


def test_chunk_out_of_range_dim_names_the_shape():
    with pytest.raises(ConversionError, match=r"dim=2 is out of range .* \(4, 4\)"):
        ops.Chunk(dim=2).convert([torch.zeros(4, 4)], _ctx(2))


# --------------------------------------------------------------------------- module lists


def test_merge_modulelist_stacks_each_gathered_list():
    w1 = [torch.full((2, 3), float(i)) for i in range(4)]
    (stacked,) = ops.MergeModulelist(dim=0).convert([w1], _ctx())
    assert stacked.shape == (4, 2, 3)
    assert stacked[:, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_merge_modulelist_refuses_mixed_shapes():
    with pytest.raises(ConversionError, match="different shapes"):
        ops.MergeModulelist().convert([[torch.zeros(2, 3), torch.zeros(3, 3)]], _ctx())


def test_split_modulelist_refuses_an_empty_stack():
    with pytest.raises(ConversionError, match=r"\(0, 3\) is empty"):
        ops.SplitModulelist(dim=0).convert([torch.zeros(0, 3)], _ctx())


def test_split_modulelist_unstacks_into_a_list():
    t = torch.arange(24).reshape(4, 2, 3)
    (parts,) = ops.SplitModulelist(dim=0).convert([t], _ctx())
    assert len(parts) == 4 and all(torch.equal(p, t[i]) for i, p in enumerate(parts))


def test_mixtral_gate_up_merge_is_stack_then_concat_of_w1_then_w3():
    experts, inter, hidden = 8, 5, 3
    w1 = [torch.randn(inter, hidden) for _ in range(experts)]
    w3 = [torch.randn(inter, hidden) for _ in range(experts)]
    (fused,) = ops.run_chain([ops.MergeModulelist(0), ops.Concatenate(1)], [w1, w3], _ctx())
    assert fused.shape == (experts, 2 * inter, hidden)
    assert torch.equal(fused[3, :inter], w1[3]) and torch.equal(fused[3, inter:], w3[3])


def test_reverse_chain_splits_a_stacked_merge_by_the_per_expert_target_sizes():
    # gate and up of different widths: Split in the reverse chain must see (-1, inter, hidden) targets.
    chain = [ops.MergeModulelist(0), ops.Concatenate(1), ops.Transpose(1, 2)]
    w1 = [torch.randn(3, 4) for _ in range(5)]
    w3 = [torch.randn(2, 4) for _ in range(5)]
    (fused,) = ops.run_chain(chain, [w1, w3], _ctx())
    back = ops.run_chain(ops.reverse_chain(chain), [fused], _ctx(2, target_shapes=((3, 4), (2, 4))))
    assert _same_bits(back, [w1, w3])


# --------------------------------------------------------------------------- layout ops


def test_transpose_swaps_two_dims_of_every_tensor():
    out = ops.Transpose(0, 1).convert([torch.zeros(2, 3), [torch.zeros(4, 5)]], _ctx())
    assert out[0].shape == (3, 2) and out[1][0].shape == (5, 4)


def _reference_rope_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved (re, im) pairs per head → all re then all im, written out index by index."""
    rows = w.shape[0]
    head_dim = rows // heads
    order = [
        h * head_dim + 2 * i + part for h in range(heads) for part in (0, 1) for i in range(head_dim // 2)
    ]
    return w[order]


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_permute_for_rope_moves_interleaved_pairs_to_split_halves(heads):
    w = torch.arange(8 * heads * 3).reshape(8 * heads, 3)
    (out,) = ops.PermuteForRope(num_heads=heads).convert([w], _ctx())
    assert torch.equal(out, _reference_rope_permute(w, heads))


def test_permute_for_rope_head_count_is_explicit_per_target():
    # k_proj of a grouped-query model has fewer heads than q_proj: the config attribute says which.
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    k = torch.arange(16).reshape(16, 1)
    (by_attr,) = ops.PermuteForRope(config_attribute="num_key_value_heads").convert([k], _ctx(config=config))
    (by_count,) = ops.PermuteForRope(num_heads=2).convert([k], _ctx())
    assert torch.equal(by_attr, by_count)
    assert torch.equal(by_attr, _reference_rope_permute(k, 2))


def test_permute_for_rope_reads_the_text_config_of_a_composite_config():
    text = SimpleNamespace(num_key_value_heads=2)
    config = SimpleNamespace(get_text_config=lambda: text)
    k = torch.arange(8).reshape(8, 1)
    (out,) = ops.PermuteForRope(config_attribute="num_key_value_heads").convert([k], _ctx(config=config))
    assert torch.equal(out, _reference_rope_permute(k, 2))


def test_permute_for_rope_needs_exactly_one_head_source():
    with pytest.raises(ConversionError, match="exactly one of num_heads"):
        ops.PermuteForRope()
    with pytest.raises(ConversionError, match="exactly one of num_heads"):
        ops.PermuteForRope(num_heads=2, config_attribute="num_attention_heads")


def test_permute_for_rope_missing_config_attribute_names_it():
    with pytest.raises(ConversionError, match="'num_key_value_heads'"):
        ops.PermuteForRope(config_attribute="num_key_value_heads").convert(
            [torch.zeros(8, 2)], _ctx(config=None)
        )


def test_permute_for_rope_rows_not_divisible_by_heads_is_refused():
    with pytest.raises(ConversionError, match=r"\(6, 2\) does not hold 4 heads"):
        ops.PermuteForRope(num_heads=4).convert([torch.zeros(6, 2)], _ctx())


def test_permute_for_rope_slots_permutes_q_and_k_but_not_v():
    q, k, v = (torch.arange(8.0).reshape(8, 1) + i for i in (0, 100, 200))
    out = ops.PermuteForRope(num_heads=2, slots=(0, 1)).convert([q, k, v], _ctx(3))
    (want_q,) = ops.PermuteForRope(num_heads=2).convert([q], _ctx())
    assert torch.equal(out[0], want_q) and not torch.equal(out[0], q)
    assert torch.equal(out[2], v)
    assert ops.PermuteForRope(num_heads=2, slots=(0, 1)).reverse_op.slots == (0, 1)


def test_permute_for_rope_slot_out_of_range_is_refused():
    with pytest.raises(ConversionError, match=r"slots=.*out of range"):
        ops.PermuteForRope(num_heads=1, slots=(3,)).convert([torch.zeros(2, 1)] * 3, _ctx(3))


def test_permute_for_rope_reads_a_dotted_config_attribute_or_the_sub_config_itself():
    class Vision:
        num_attention_heads = 2

    class Root:
        vision_config = Vision()

    w = torch.arange(8.0).reshape(8, 1)
    (want,) = ops.PermuteForRope(num_heads=2).convert([w], _ctx())
    op = ops.PermuteForRope(config_attribute="vision_config.num_attention_heads")
    (at_root,) = op.convert([w], _ctx(config=Root()))
    (at_tower,) = op.convert([w], _ctx(config=Vision()))  # resolved at the tower: its own config
    assert torch.equal(at_root, want) and torch.equal(at_tower, want)


def test_transpose_when_shape_differs_passes_a_tensor_already_in_the_target_layout():
    op = ops.Transpose(1, 2, when_shape_differs=True)
    hub = torch.randn(4, 3, 6)
    (converted,) = op.convert([hub], _ctx(target_shapes=((4, 6, 3),)))
    assert converted.shape == (4, 6, 3) and torch.equal(converted, hub.transpose(1, 2))
    runtime = torch.randn(4, 6, 3)
    (kept,) = op.convert([runtime], _ctx(target_shapes=((4, 6, 3),)))
    assert kept is runtime
    (unknown,) = op.convert([hub], _ctx())  # no target shape (a model never loaded): transposed
    assert unknown.shape == (4, 6, 3)


def test_transpose_when_shape_differs_refuses_dims_it_cannot_tell_apart():
    op = ops.Transpose(1, 2, when_shape_differs=True)
    with pytest.raises(ConversionError, match="cannot be told"):
        op.convert([torch.zeros(2, 5, 5)], _ctx(target_shapes=((2, 5, 5),)))


def test_interleave_deinterleaves_and_its_inverse_interleaves():
    t = torch.tensor([0, 10, 1, 11, 2, 12])
    (out,) = ops.Interleave(dim=0).convert([t], _ctx())
    assert out.tolist() == [0, 1, 2, 10, 11, 12]
    (back,) = ops.Interleave(dim=0, inverse=True).convert([out], _ctx())
    assert back.tolist() == t.tolist()


def test_conv3d_to_linear_computes_the_same_patch_embedding():
    conv = torch.nn.Conv3d(3, 6, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=False)
    patches = torch.randn(5, 3, 2, 4, 4)
    (weight,) = ops.Conv3dToLinear(in_channels=3, kernel_size=(2, 4, 4)).convert(
        [conv.weight.detach()], _ctx()
    )
    assert weight.shape == (6, 3 * 2 * 4 * 4)
    expected = conv(patches).reshape(5, 6)
    torch.testing.assert_close(F.linear(patches.reshape(5, -1), weight), expected)


def test_conv3d_to_linear_refuses_a_kernel_mismatch():
    with pytest.raises(ConversionError, match=r"\(out, 3, 2, 4, 4\), got \(6, 3, 1, 4, 4\)"):
        ops.Conv3dToLinear(in_channels=3, kernel_size=(2, 4, 4)).convert([torch.zeros(6, 3, 1, 4, 4)], _ctx())


def test_linear_to_conv3d_refuses_the_wrong_fan_in():
    with pytest.raises(ConversionError, match=r"\(out, 96\), got \(6, 95\)"):
        ops.LinearToConv3d(in_channels=3, kernel_size=(2, 4, 4)).convert([torch.zeros(6, 95)], _ctx())


# --------------------------------------------------------------------------- chains and custom ops


@dataclass(frozen=True)
class Scale(ops.ConversionOp):
    """A custom op: multiply by a power of two (exact in floating point)."""

    factor: float = 2.0

    def convert(self, slots, ctx):
        return [s * self.factor for s in slots]

    @property
    def reverse_op(self):
        return Scale(1.0 / self.factor)


def test_a_custom_op_subclasses_conversion_op_and_reverses():
    chain = [Scale(4.0), ops.Transpose(0, 1)]
    x = torch.randn(3, 5)
    (y,) = ops.run_chain(chain, [x], _ctx())
    assert torch.equal(y, (x * 4).T)
    (back,) = ops.run_chain(ops.reverse_chain(chain), [y], _ctx())
    assert torch.equal(back, x)


def test_a_custom_op_failure_becomes_a_conversion_error_naming_op_and_key():
    @dataclass(frozen=True)
    class Broken(ops.ConversionOp):
        def convert(self, slots, ctx):
            raise RuntimeError("boom")

        @property
        def reverse_op(self):
            return self

    with pytest.raises(ConversionError, match=r"Broken\(\) for target a\.weight raised RuntimeError: boom"):
        ops.run_chain([Broken()], [torch.zeros(1)], _ctx(target_keys=("a.weight",)))


def test_an_op_without_convert_is_reported_not_crashed():
    with pytest.raises(ConversionError, match="must implement convert"):
        ops.run_chain([ops.ConversionOp()], [torch.zeros(1)], _ctx())


def test_run_chain_checks_it_ends_with_one_slot_per_target():
    with pytest.raises(ConversionError, match=r"produced 2 tensors for 1 target"):
        ops.run_chain([ops.Chunk(dim=0, chunks=2)], [torch.zeros(4)], _ctx(1))


def test_reverse_chain_inverts_each_op_in_reverse_order():
    chain = [ops.MergeModulelist(0), ops.Concatenate(1)]
    assert ops.reverse_chain(chain) == [ops.Split(sizes=None, dim=1), ops.SplitModulelist(0)]


def test_every_error_is_a_surgery_error():
    assert issubclass(ConversionError, SurgeryError)


# --------------------------------------------------------------------------- property: exact inverses


@st.composite
def _tensor(draw, shape, dtype=None):
    dtype = dtype or draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    bits = _BITS[dtype]
    info = torch.iinfo(bits)
    # Random bit patterns: NaNs, infinities and subnormals included, so equality is truly bitwise.
    raw = torch.randint(info.min, info.max + 1, tuple(shape), generator=gen, dtype=torch.int64)
    return raw.to(bits).view(dtype)


_SIZE = st.integers(0, 4)


def _shape(min_dims=1, max_dims=4):
    return st.lists(_SIZE, min_size=min_dims, max_size=max_dims).map(tuple)


@st.composite
def op_cases(draw):
    """(op, input slots, context for the reverse direction)."""
    kind = draw(
        st.sampled_from(
            [
                "chunk",
                "split",
                "concat",
                "merge",
                "unmerge",
                "transpose",
                "transpose_when_differs",
                "rope",
                "rope_slots",
                "interleave",
                "conv3d",
                "linear",
            ]
        )
    )
    if kind in ("chunk", "split"):
        shape = list(draw(_shape()))
        dim = draw(st.integers(-len(shape), len(shape) - 1))
        if kind == "chunk":
            n = draw(st.integers(1, 3))
            shape[dim] = n * draw(_SIZE)
            op = ops.Chunk(dim=dim, chunks=n)
            sizes = [shape[dim] // n] * n
        else:
            sizes = draw(st.lists(_SIZE, min_size=1, max_size=4))
            shape[dim] = sum(sizes)
            op = ops.Split(sizes=tuple(sizes), dim=dim)
        return op, [draw(_tensor(shape))], _ctx(1)
    if kind == "concat":
        base = list(draw(_shape()))
        dim = draw(st.integers(-len(base), len(base) - 1))
        dtype = draw(st.sampled_from(DTYPES))
        tensors = []
        for _ in range(draw(st.integers(1, 4))):
            shape = list(base)
            shape[dim] = draw(_SIZE)
            tensors.append(draw(_tensor(shape, dtype)))
        shapes = tuple(tuple(t.shape) for t in tensors)
        return ops.Concatenate(dim=dim), tensors, _ctx(len(tensors), target_shapes=shapes)
    if kind == "merge":
        shape = draw(_shape(0, 3))
        dim = draw(st.integers(-(len(shape) + 1), len(shape)))
        n_slots = draw(st.integers(1, 2))
        slots = []
        for _ in range(n_slots):
            dtype = draw(st.sampled_from(DTYPES))
            slots.append([draw(_tensor(shape, dtype)) for _ in range(draw(st.integers(1, 4)))])
        return ops.MergeModulelist(dim=dim), slots, _ctx(n_slots)
    if kind == "unmerge":
        shape = list(draw(_shape()))
        dim = draw(st.integers(-len(shape), len(shape) - 1))
        shape[dim] = draw(st.integers(1, 4))  # an empty stack has no list to give back
        return ops.SplitModulelist(dim=dim), [draw(_tensor(shape))], _ctx(1)
    if kind == "transpose":
        shape = draw(_shape())
        dim0 = draw(st.integers(-len(shape), len(shape) - 1))
        dim1 = draw(st.integers(-len(shape), len(shape) - 1))
        return ops.Transpose(dim0, dim1), [draw(_tensor(shape))], _ctx(1)
    if kind == "transpose_when_differs":
        shape = list(draw(_shape(2, 4)))
        dim0, dim1 = draw(st.permutations(range(len(shape))))[:2]
        assume(shape[dim0] != shape[dim1])
        op = ops.Transpose(dim0, dim1, when_shape_differs=True)
        return op, [draw(_tensor(tuple(shape)))], _ctx(1, target_shapes=(tuple(shape),))
    if kind == "rope_slots":
        heads = draw(st.integers(1, 3))
        rows = heads * 2 * draw(st.integers(1, 3))
        slots = [draw(_tensor((rows, draw(_SIZE)))) for _ in range(3)]
        chosen = tuple(draw(st.sets(st.integers(-3, 2), min_size=1, max_size=3)))
        op = ops.PermuteForRope(num_heads=heads, inverse=draw(st.booleans()), slots=chosen)
        return op, slots, _ctx(3)
    if kind == "rope":
        heads = draw(st.integers(1, 4))
        rows = heads * 2 * draw(st.integers(0, 3))
        shape = (rows,) if draw(st.booleans()) else (rows, draw(_SIZE))
        op = ops.PermuteForRope(num_heads=heads, inverse=draw(st.booleans()))
        return op, [draw(_tensor(shape))], _ctx(1)
    if kind == "interleave":
        shape = list(draw(_shape()))
        dim = draw(st.integers(-len(shape), len(shape) - 1))
        shape[dim] = 2 * draw(_SIZE)
        op = ops.Interleave(dim=dim, inverse=draw(st.booleans()))
        return op, [draw(_tensor(shape))], _ctx(1)
    channels = draw(st.integers(1, 3))
    kernel = tuple(draw(st.lists(st.integers(1, 3), min_size=3, max_size=3)))
    out = draw(_SIZE)
    if kind == "conv3d":
        return ops.Conv3dToLinear(channels, kernel), [draw(_tensor((out, channels, *kernel)))], _ctx(1)
    fan_in = channels * kernel[0] * kernel[1] * kernel[2]
    return ops.LinearToConv3d(channels, kernel), [draw(_tensor((out, fan_in)))], _ctx(1)


@settings(max_examples=100, deadline=None)
@given(op_cases())
def test_every_op_is_undone_bit_for_bit_by_its_reverse_op(case):
    op, slots, reverse_ctx = case
    forward = op.convert(slots, _ctx(len(slots)))
    back = op.reverse_op.convert(forward, reverse_ctx)
    assert _same_bits(back, slots)


@settings(max_examples=50, deadline=None)
@given(op_cases())
def test_reversing_an_op_twice_gives_an_op_with_the_same_effect(case):
    op, slots, _ = case
    forward = op.convert(slots, _ctx(len(slots)))
    again = op.reverse_op.reverse_op.convert(slots, _ctx(len(forward), target_shapes=_shapes_of(forward)))
    assert _same_bits(again, forward)


def _shapes_of(slots):
    return tuple(tuple(s[0].shape) if isinstance(s, list) else tuple(s.shape) for s in slots)


@pytest.mark.parametrize("slots", [(), (True,), (1.5,), 0, ("a",)])
def test_permute_for_rope_slots_must_name_tensor_positions(slots):
    with pytest.raises(ConversionError, match="non-empty tuple of tensor positions"):
        ops.PermuteForRope(num_heads=1, slots=slots)


def test_transpose_when_shape_differs_needs_two_different_dims():
    with pytest.raises(ConversionError, match="two different dims"):
        ops.Transpose(1, 1, when_shape_differs=True)


def test_permute_for_rope_dotted_attribute_never_reads_the_text_config():
    class Vision:
        num_heads = 4  # spelled differently: not the attribute asked for

    class Text:
        num_attention_heads = 2

    class Root:
        vision_config = Vision()

        def get_text_config(self):
            return Text()

    op = ops.PermuteForRope(config_attribute="vision_config.num_attention_heads")
    with pytest.raises(ConversionError, match="no positive integer"):
        op.convert([torch.zeros(8, 1)], _ctx(config=Root()))


def test_transpose_when_shape_differs_refuses_a_target_of_another_shape():
    op = ops.Transpose(1, 2, when_shape_differs=True)
    with pytest.raises(ConversionError, match="last op of a chain"):
        op.convert([torch.zeros(4, 3, 6)], _ctx(target_shapes=((3, 6),)))
