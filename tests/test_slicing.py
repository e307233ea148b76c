"""Slice rules: reading a region of every source and running the local chain equals slicing the
full result, bit for bit, for every built-in op (hypothesis), and ops without an exact rule say so.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from surgery import ConfigurationError, ops
from surgery.load.sharding import trace_regions
from surgery.ops import OpContext, run_chain
from surgery.parallel.regions import NOT_NEEDED, Region, take_slot


def _shapes(slots):
    return [[tuple(t.shape) for t in s] if isinstance(s, list) else tuple(s.shape) for s in slots]


def _stages(chain, inputs, ctx):
    stages, slots = [_shapes(inputs)], inputs
    for op in chain:
        slots = op.convert(slots, ctx)
        stages.append(_shapes(slots))
    return stages, slots


def _equal(a, b) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and torch.equal(a, b)


def local_matches(chain, inputs, regions, ctx=None) -> bool | None:
    """``None`` when the chain has no rule; else whether local == region of the global result."""
    ctx = ctx or OpContext(n_targets=len(regions))
    stages, full = _stages(chain, inputs, ctx)
    traced = trace_regions(chain, stages, regions, ctx)
    if traced.blocked_by is not None:
        return None
    local_in = [take_slot(x, r) for x, r in zip(inputs, traced.sources)]
    local_out = run_chain(traced.operations, local_in, OpContext(n_targets=len(regions), config=ctx.config))
    return _equal(local_out, [take_slot(o, r) for o, r in zip(full, regions)])


def _region(size: int, data, *, dim: int) -> Region:
    """One or two random intervals of a dim of ``size``."""
    cuts = sorted(data.draw(st.lists(st.integers(0, size), min_size=2, max_size=4)))
    pairs = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    return Region.of(dim, pairs)


def _t(*shape):
    return torch.randn(*shape)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_concatenate_reads_only_each_inputs_share(data):
    dim = data.draw(st.integers(0, 1))
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=2, max_size=3))
    other = data.draw(st.integers(1, 4))
    inputs = [_t(*((s, other) if dim == 0 else (other, s))) for s in sizes]
    out_dim = data.draw(st.integers(0, 1))
    total = (sum(sizes), other)[out_dim] if dim == 0 else (other, sum(sizes))[out_dim]
    region = _region(total, data, dim=out_dim)
    assert local_matches([ops.Concatenate(dim=dim)], inputs, [region]) is True


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_chunk_and_split_read_the_union_of_their_outputs_regions(data):
    parts = data.draw(st.integers(2, 3))
    each = data.draw(st.lists(st.integers(1, 4), min_size=parts, max_size=parts))
    cols = data.draw(st.integers(1, 4))
    equal = data.draw(st.booleans())
    if equal:
        each = [each[0]] * parts
        op = ops.Chunk(dim=0)
    else:
        op = ops.Split(sizes=tuple(each), dim=0)
    x = _t(sum(each), cols)
    if data.draw(st.booleans()):  # along the split: each output its own rows
        regions = [data.draw(st.one_of(st.none(), st.just(0))) for _ in each]
        regions = [None if r is None else _region(n, data, dim=0) for r, n in zip(regions, each)]
    else:  # across it: the same columns of every output
        r = _region(cols, data, dim=1)
        regions = [r] * parts
    assert local_matches([op], [x], regions) is True


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_merged_experts_with_a_packed_gate_up_read_half_of_every_w1_and_w3(data):
    experts, inter, hidden = (
        data.draw(st.integers(1, 4)),
        2 * data.draw(st.integers(1, 3)),
        data.draw(st.integers(1, 3)),
    )
    w1 = [_t(inter, hidden) for _ in range(experts)]
    w3 = [_t(inter, hidden) for _ in range(experts)]
    rank, world = data.draw(st.integers(0, 1)), 2
    step = inter // world
    # _StridedShard(1, split_factor=2) on (E, 2I, H): [G_r | U_r]
    packed = Region.of(
        1, [(rank * step, (rank + 1) * step), (inter + rank * step, inter + (rank + 1) * step)]
    )
    chain = [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)]
    assert local_matches(chain, [w1, w3], [packed]) is True
    stages, _ = _stages(chain, [w1, w3], OpContext())
    traced = trace_regions(chain, stages, [packed])
    assert traced.sources == [[Region(0, ((rank * step, (rank + 1) * step),))] * experts] * 2


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_merge_on_the_stacked_dim_skips_other_ranks_experts(data):
    experts = data.draw(st.integers(2, 6))
    items = [_t(3, 2) for _ in range(experts)]
    region = _region(experts, data, dim=0)
    chain = [ops.MergeModulelist(dim=0)]
    assert local_matches(chain, [items], [region]) is (True if region.size else None)
    stages, _ = _stages(chain, [items], OpContext())
    traced = trace_regions(chain, stages, [region])
    if traced.blocked_by is None and traced.sources != [None]:
        kept = {i for a, b in region.intervals for i in range(a, b)}
        assert [r is not NOT_NEEDED for r in traced.sources[0]] == [i in kept for i in range(experts)]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_split_modulelist_and_transpose(data):
    e, a, b = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    stacked = _t(e, a, b)
    dim = data.draw(st.integers(0, 1))
    r = _region((a, b)[dim], data, dim=dim)
    assert local_matches([ops.SplitModulelist(dim=0)], [stacked], [[r] * e]) is True
    d = data.draw(st.integers(0, 1))
    r2 = _region((b, a)[d], data, dim=d)
    assert local_matches([ops.Transpose(0, 1)], [_t(a, b)], [r2]) is True


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_rope_permute_keeps_whole_heads_with_the_local_head_count(data):
    heads, half = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    rows = heads * 2 * half
    w = _t(rows, 3)
    first = data.draw(st.integers(0, heads - 1))
    last = data.draw(st.integers(first + 1, heads))
    region = Region(0, ((first * 2 * half, last * 2 * half),))
    inverse = data.draw(st.booleans())
    op = ops.PermuteForRope(num_heads=heads, inverse=inverse)
    assert local_matches([op], [w], [region]) is True
    cols = Region(1, ((0, 2),))
    assert local_matches([op], [w], [cols]) is True


def test_rope_permute_across_a_head_has_no_rule():
    w = _t(8, 2)
    assert local_matches([ops.PermuteForRope(num_heads=2)], [w], [Region(0, ((0, 2),))]) is None


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_interleave_packed_region_is_one_input_range(data):
    n = data.draw(st.integers(1, 4))
    x = _t(2 * n, 3)
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a + 1, n))
    packed = Region.of(0, [(a, b), (n + a, n + b)])
    assert local_matches([ops.Interleave(dim=0)], [x], [packed]) is True
    even = Region(0, ((2 * a, 2 * b),))
    assert local_matches([ops.Interleave(dim=0, inverse=True)], [x], [even]) is True
    assert local_matches([ops.Interleave(dim=0)], [x], [Region(1, ((0, 1),))]) is True


def test_interleave_plain_shard_on_its_dim_has_no_rule():
    assert local_matches([ops.Interleave(dim=0)], [_t(8, 2)], [Region(0, ((0, 4),))]) is None


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_conv3d_to_linear_in_whole_channels(data):
    out, c = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    k = (1, 2, 2)
    w = _t(out, c, *k)
    op = ops.Conv3dToLinear(c, k)
    first = data.draw(st.integers(0, c - 1))
    last = data.draw(st.integers(first + 1, c))
    assert local_matches([op], [w], [Region(1, ((first * 4, last * 4),))]) is True
    assert local_matches([op], [w], [_region(out, data, dim=0)]) is True
    back = ops.LinearToConv3d(c, k)
    assert local_matches([back], [w.reshape(out, -1)], [Region(1, ((first, last),))]) is True


def test_conv3d_to_linear_across_a_channel_has_no_rule():
    w = _t(2, 2, 1, 2, 2)
    assert local_matches([ops.Conv3dToLinear(2, (1, 2, 2))], [w], [Region(1, ((0, 3),))]) is None


def test_a_custom_op_without_a_rule_blocks_the_walk_and_is_named():
    class Scale(ops.ConversionOp):
        def convert(self, slots, ctx):
            return [s * 2 for s in slots]

        @property
        def reverse_op(self):
            return self

    chain = [ops.Concatenate(dim=0), Scale()]
    stages, _ = _stages(chain, [_t(2, 2), _t(2, 2)], OpContext())
    traced = trace_regions(chain, stages, [Region(0, ((0, 2),))])
    assert isinstance(traced.blocked_by, Scale)


def test_region_normalizes_its_intervals():
    assert Region.of(0, [(4, 6), (0, 2), (2, 3), (5, 5)]) == Region(0, ((0, 3), (4, 6)))
    with pytest.raises(ConfigurationError):
        trace_regions([ops.Concatenate(dim=0)], [[(2,)]], [None, None])
