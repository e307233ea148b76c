"""The fusion plan: what :func:`~surgery.preview_fusions` found and :func:`~surgery.apply_fusions` did.

Per candidate module: its path and class, whether it matched and why (or why not), the fx graph
before and after (as generated code and as nodes), parameter names and shapes before and after,
and the weight transforms the fusion registers. A plan renders as text (``str(plan)``), as a
dict (:meth:`FusionPlan.to_dict`, JSON-serializable) and as Mermaid or Graphviz DOT diagrams of
the before/after graphs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..transforms import WeightTransform

__all__ = [
    "EXCLUDED",
    "FUSED",
    "SKIPPED",
    "WOULD_FUSE",
    "FusionCandidate",
    "FusionPlan",
    "GraphNode",
    "GraphSnapshot",
    "TensorSummary",
    "tensor_summaries",
]

FUSED = "fused"
"""Status of a candidate that :func:`~surgery.apply_fusions` rewrote."""
WOULD_FUSE = "would fuse"
"""Status of a candidate that matched in a preview."""
SKIPPED = "skipped"
"""Status of a candidate that is not fusable, could not be traced, or did not match."""
EXCLUDED = "excluded"
"""Status of a candidate the ``exclude`` option left alone."""


@dataclass(frozen=True)
class TensorSummary:
    """Shape and dtype of one parameter or buffer."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSummary:
        return cls(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))

    def __str__(self) -> str:
        return f"{list(self.shape)} {self.dtype}"


def tensor_summaries(module: nn.Module) -> dict[str, TensorSummary]:
    """``{state_dict key: TensorSummary}`` of ``module`` (keys relative to the module)."""
    return {
        k: TensorSummary.of(v)
        for k, v in module.state_dict(keep_vars=True).items()
        if isinstance(v, torch.Tensor)
    }


def _target_text(node: fx.Node) -> str:
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return f".{node.target}"
    return str(node.target)


@dataclass(frozen=True)
class GraphNode:
    """One fx node, reduced to what diagrams need."""

    name: str
    op: str
    target: str
    inputs: tuple[str, ...]


@dataclass(frozen=True)
class GraphSnapshot:
    """An fx graph as generated Python code and as a node list."""

    code: str
    nodes: tuple[GraphNode, ...]

    @classmethod
    def of(cls, graph: fx.Graph, *, code: str | None = None) -> GraphSnapshot:
        """Snapshot ``graph``; ``code``: its generated source if already at hand (``GraphModule.code``)."""
        src = graph.python_code(root_module="self").src if code is None else code
        code = "\n".join(line.rstrip() for line in src.strip("\n").splitlines()).strip("\n")
        nodes = tuple(
            GraphNode(n.name, n.op, _target_text(n), tuple(a.name for a in n.all_input_nodes))
            for n in graph.nodes
        )
        return cls(code, nodes)


@dataclass
class FusionCandidate:
    """One candidate module of one fusion.

    Attributes:
        fusion: the fusion name.
        path: dotted module path in the model (``""`` is the root).
        class_name: the candidate's class name.
        status: :data:`FUSED`, :data:`WOULD_FUSE`, :data:`SKIPPED` or :data:`EXCLUDED`.
        reason: why it matched (the matched pattern) or why not.
        fused_class_name: the replacement's class name when it matched.
        before / after: the traced graph before and after the rewrite (``after`` only if matched).
        params_before / params_after: ``state_dict`` keys relative to the module, with shapes.
        transforms: the weight transforms (original → fused layout), scoped to ``path``.
    """

    fusion: str
    path: str
    class_name: str
    status: str
    reason: str
    fused_class_name: str | None = None
    before: GraphSnapshot | None = None
    after: GraphSnapshot | None = None
    params_before: dict[str, TensorSummary] = field(default_factory=dict)
    params_after: dict[str, TensorSummary] = field(default_factory=dict)
    transforms: tuple[WeightTransform, ...] = ()

    @property
    def matched(self) -> bool:
        """Whether the pattern matched (fused, or would be in a preview)."""
        return self.status in (FUSED, WOULD_FUSE)

    @property
    def display_path(self) -> str:
        return self.path or "<root>"

    def to_dict(self) -> dict[str, Any]:
        return {
            "fusion": self.fusion,
            "path": self.path,
            "class_name": self.class_name,
            "status": self.status,
            "matched": self.matched,
            "reason": self.reason,
            "fused_class_name": self.fused_class_name,
            "code_before": self.before.code if self.before else None,
            "code_after": self.after.code if self.after else None,
            "params_before": {
                k: {"shape": list(v.shape), "dtype": v.dtype} for k, v in self.params_before.items()
            },
            "params_after": {
                k: {"shape": list(v.shape), "dtype": v.dtype} for k, v in self.params_after.items()
            },
            "transforms": [repr(t) for t in self.transforms],
        }


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


@dataclass
class FusionPlan:
    """What a fusion config finds (and, when applied, did) in one model.

    Attributes:
        config: the canonical validated config (see :meth:`FusionConfig.to_dict`).
        applied: ``True`` for :func:`~surgery.apply_fusions`, ``False`` for a preview.
        fusions: the enabled fusion names, in the order they ran.
        candidates: one entry per candidate, per fusion, in model order.
        messages: per fusion that matched nothing, what it looked for and how to point it elsewhere.
    """

    config: dict[str, Any]
    applied: bool
    fusions: tuple[str, ...] = ()
    candidates: list[FusionCandidate] = field(default_factory=list)
    messages: dict[str, str] = field(default_factory=dict)

    @property
    def matched(self) -> list[FusionCandidate]:
        """The candidates that were fused (or would be)."""
        return [c for c in self.candidates if c.matched]

    @property
    def skipped(self) -> list[FusionCandidate]:
        """The candidates left alone (not fusable, untraceable, no match, or excluded)."""
        return [c for c in self.candidates if not c.matched]

    def transforms(self) -> list[WeightTransform]:
        """Fresh copies of every matched candidate's transforms, in plan order."""
        return [t.copy() for c in self.matched for t in c.transforms]

    # ------------------------------------------------------------------ text
    def render(self, *, graphs: bool = True) -> str:
        """The plan as text; ``graphs=False`` leaves out the generated code."""
        head = "Fusion plan (applied)" if self.applied else "Fusion plan (preview: nothing was changed)"
        lines = [f"{head}; config: {json.dumps(self.config)}"]
        if not self.fusions:
            lines.append("  no fusion enabled")
        for name in self.fusions:
            mine = [c for c in self.candidates if c.fusion == name]
            n_matched = sum(c.matched for c in mine)
            verb = "fused" if self.applied else "would fuse"
            lines.append(f"fusion {name!r}: {verb} {n_matched} of {len(mine)} candidate(s)")
            if name in self.messages:
                lines.append(f"  {self.messages[name]}")
            for c in mine:
                lines.extend(self._render_candidate(c, graphs))
        return "\n".join(lines)

    def _render_candidate(self, c: FusionCandidate, graphs: bool) -> list[str]:
        arrow = f" -> {c.fused_class_name}" if c.fused_class_name else ""
        out = [f"  [{c.status}] {c.display_path} ({c.class_name}{arrow})", f"    why: {c.reason}"]
        if c.params_before:
            out.append("    parameters before:")
            out.extend(f"      {k}: {v}" for k, v in c.params_before.items())
        if c.matched:
            out.append("    parameters after:")
            out.extend(f"      {k}: {v}" for k, v in c.params_after.items())
            out.append("    weight transforms (original -> fused layout):")
            out.extend(f"      {t!r}" for t in c.transforms)
        if graphs and c.before is not None:
            out.append("    graph before:")
            out.append(_indent(c.before.code, "      "))
        if graphs and c.after is not None:
            out.append("    graph after:")
            out.append(_indent(c.after.code, "      "))
        return out

    def __str__(self) -> str:
        return self.render()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict of the whole plan."""
        return {
            "config": self.config,
            "applied": self.applied,
            "fusions": list(self.fusions),
            "messages": dict(self.messages),
            "candidates": [c.to_dict() for c in self.candidates],
        }

    # ------------------------------------------------------------------ diagrams
    def _diagrammed(self) -> list[tuple[int, FusionCandidate]]:
        return [(i, c) for i, c in enumerate(self.candidates) if c.before is not None]

    def to_mermaid(self, *, full: bool = False) -> str:
        """A Mermaid ``flowchart`` of every traced candidate's graph before and after the rewrite.

        Args:
            full: every node of each graph. By default a graph shows the rewritten region (the
                nodes the rewrite removed or added) and its direct neighbours (their inputs and
                users), with one node counting the rest; a candidate that was not rewritten
                shows only that count.
        """
        lines = ["flowchart TB"]
        for i, c in self._diagrammed():
            for tag, snap, shown in _shown(c, full=full):
                sid = f"c{i}_{tag}"
                lines.append(f'  subgraph {sid}["{_mermaid_text(f"{c.display_path} ({tag})")}"]')
                for n in snap.nodes:
                    if n.name in shown:
                        lines.append(f'    {sid}_{n.name}["{_mermaid_text(f"{n.name}: {n.op} {n.target}")}"]')
                if len(shown) < len(snap.nodes):
                    hidden = (
                        f"{len(snap.nodes) - len(shown)} unchanged nodes not shown (full=True shows them)"
                    )
                    lines.append(f'    {sid}__hidden["{hidden}"]')
                for n in snap.nodes:
                    lines.extend(
                        f"    {sid}_{src} --> {sid}_{n.name}" for src in n.inputs if {src, n.name} <= shown
                    )
                lines.append("  end")
        return "\n".join(lines)

    def to_dot(self, *, full: bool = False) -> str:
        """A Graphviz ``digraph`` with one cluster per traced candidate graph (``full``: as :meth:`to_mermaid`)."""
        lines = ["digraph fusion_plan {", "  rankdir=TB;", "  node [shape=box, fontname=monospace];"]
        for i, c in self._diagrammed():
            for tag, snap, shown in _shown(c, full=full):
                sid = f"c{i}_{tag}"
                lines.append(f"  subgraph cluster_{sid} {{")
                lines.append(f"    label={json.dumps(f'{c.display_path} ({tag})')};")
                for n in snap.nodes:
                    if n.name in shown:
                        lines.append(
                            f"    {sid}_{n.name} [label={json.dumps(f'{n.name}: {n.op} {n.target}')}];"
                        )
                if len(shown) < len(snap.nodes):
                    hidden = (
                        f"{len(snap.nodes) - len(shown)} unchanged nodes not shown (full=True shows them)"
                    )
                    lines.append(f"    {sid}__hidden [label={json.dumps(hidden)}, style=dashed];")
                for n in snap.nodes:
                    lines.extend(
                        f"    {sid}_{src} -> {sid}_{n.name};" for src in n.inputs if {src, n.name} <= shown
                    )
                lines.append("  }")
        lines.append("}")
        return "\n".join(lines)


def _shown(c: FusionCandidate, *, full: bool) -> list[tuple[str, GraphSnapshot, set[str]]]:
    """``(tag, graph, names of the nodes to draw)`` for the candidate's graphs before and after.

    Not ``full``: the nodes only one of the two graphs has (same name, op, target and inputs
    count as the same node), plus their inputs and users in that graph.
    """
    pairs = [(tag, snap) for tag, snap in (("before", c.before), ("after", c.after)) if snap is not None]
    if full:
        return [(tag, snap, {n.name for n in snap.nodes}) for tag, snap in pairs]
    if c.before is None or c.after is None:
        return [(tag, snap, set()) for tag, snap in pairs]  # nothing rewritten
    out = []
    for tag, snap in pairs:
        other = c.after if snap is c.before else c.before
        same = set(other.nodes)
        changed = {n.name for n in snap.nodes if n not in same}
        shown = set(changed)
        for n in snap.nodes:
            if n.name in changed:
                shown.update(n.inputs)  # its inputs
            elif changed.intersection(n.inputs):
                shown.add(n.name)  # a user of a changed node
        out.append((tag, snap, shown))
    return out


def _mermaid_text(text: str) -> str:
    return text.replace('"', "#quot;").replace("<", "#lt;").replace(">", "#gt;")
