"""The generic fx dataflow analyses of ``surgery.fusion.matching``, on traced modules."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from surgery.fusion.matching import (
    ALIASING_METHODS,
    PASSTHROUGH_METHODS,
    aliases_and_users,
    depends_on_layout,
    descendants,
    writes_in_place,
)


class Writes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        v = y.view(2, 2, 4).transpose(0, 1)  # aliases y
        v.add_(1)
        s = y + 1  # a new tensor: its users are not y's
        s.mul_(2)
        t = F.relu(s, inplace=True)
        return self.act(t) + v.sum() + y.stride(0)


def _traced() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    gm = fx.symbolic_trace(Writes())
    return gm, {n.name: n for n in gm.graph.nodes}


def test_every_passthrough_cast_may_alias_its_input() -> None:
    assert PASSTHROUGH_METHODS <= ALIASING_METHODS


def test_aliases_and_users_follows_views_and_stops_at_new_tensors() -> None:
    _, nodes = _traced()
    reached = {n.name for n in aliases_and_users(nodes["proj"])}
    assert {"view", "transpose", "add_", "add", "stride"} <= reached  # add_ writes through the view
    assert "mul_" not in reached  # it writes y + 1, a tensor of its own


def test_writes_in_place_knows_methods_functions_operators_and_modules() -> None:
    gm, _ = _traced()
    written = {n.name for n in gm.graph.nodes if writes_in_place(n, gm)}
    assert written == {"add_", "mul_", "relu", "act"}
    graph = fx.Graph()  # an augmented assignment recorded as a call (fx traces `t += 1` as add)
    t = graph.placeholder("t")
    assert writes_in_place(graph.call_function(operator.iadd, (t, 1)), gm)
    assert not writes_in_place(graph.call_function(operator.add, (t, 1)), gm)


def test_a_stride_query_depends_on_the_layout_and_a_sum_does_not() -> None:
    gm, nodes = _traced()
    assert depends_on_layout(nodes["stride"], gm)
    assert not depends_on_layout(nodes["sum_1"], gm)


def test_descendants_are_every_node_downstream() -> None:
    _, nodes = _traced()
    downstream = {n.name for n in descendants(nodes["add"])}  # y + 1
    assert {"mul_", "relu", "act", "output"} <= downstream
    assert "view" not in downstream and nodes["add"] not in downstream
