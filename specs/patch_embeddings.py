r"""The ``patch_embeddings`` fusion: a Conv3d patch embedding becomes one flattened ``nn.Linear``.

Vision towers such as Qwen2-VL's and Qwen3-VL's embed non-overlapping video patches with a
``Conv3d`` whose kernel equals its stride::

    x.view(-1, C, T, P, P) -> Conv3d(C, D, kernel=(T, P, P), stride=(T, P, P)) -> .view(-1, D)

Each output is one dot product over a whole ``(C, T, P, P)`` patch, so the same map is
``x.view(-1, C*T*P*P) -> Linear(C*T*P*P, D) -> .view(-1, D)`` with the weight reshaped row-major
to ``(D, C*T*P*P)`` (the flattening order of the input view and of the weight agree).

A module is fused because its traced graph has that shape, never because of its class name:
a ``Conv3d`` child with kernel == stride, no padding, dilation 1 and groups 1, fed (through
casts such as ``.to(dtype)``) by a reshape to ``(-1, C, T, P, P)`` and followed by a flatten or
reshape to ``(-1, D)``. The new child is named ``linear_`` + the conv's name (``linear_proj``
for ``proj``, as in transformers, so runtime-layout checkpoints interoperate). Weights move with
``ops.Conv3dToLinear`` (``proj.weight`` ⇄ ``linear_proj.weight``) and a renaming of the bias,
both scoped to the module's own path.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import fx, nn

from surgery import WeightConverter, WeightRenaming, ops
from surgery.fusion import FusionMatch, FusionSpec, GraphRewrite, register_fusion, trace_module
from surgery.fusion.matching import (
    child_problem,
    child_reads,
    flattens_to_width,
    reads_only_metadata,
    reshape_shape,
    skip_passthrough_back,
    skip_passthrough_forward,
)
from surgery.transforms import WeightTransform

__all__ = ["FUSIONS", "PatchEmbedMatch", "PatchEmbeddingsFusion", "register"]


@dataclass(frozen=True)
class PatchEmbedMatch(FusionMatch):
    """A matched ``reshape -> Conv3d -> flatten`` chain.

    Attributes:
        conv: name of the Conv3d child; ``linear``: name of its replacement child.
        in_channels / kernel_size / out_channels / bias: read from the conv itself.
        reshape: the input reshape node; ``call``: the conv's ``call_module`` node.
        reads: ``get_attr`` nodes reading the conv's weight or bias (e.g. for ``.dtype``).
    """

    conv: str
    linear: str
    in_channels: int
    kernel_size: tuple[int, int, int]
    out_channels: int
    bias: bool
    reshape: str
    call: str
    reads: tuple[str, ...]


def _conv_problem(conv: nn.Conv3d) -> str | None:
    """Why ``conv`` cannot become a Linear, or ``None``."""
    problem = child_problem(conv, nn.Conv3d)
    if problem is not None:
        return problem
    kernel, stride = tuple(conv.kernel_size), tuple(conv.stride)
    if kernel != stride:
        return f"kernel_size {kernel} != stride {stride}, so patches overlap or leave gaps"
    padding = conv.padding
    if not (padding == "valid" or (isinstance(padding, tuple) and all(p == 0 for p in padding))):
        return f"padding is {padding!r}, not zero"
    if tuple(conv.dilation) != (1, 1, 1):
        return f"dilation is {tuple(conv.dilation)}, not (1, 1, 1)"
    if conv.groups != 1:
        return f"groups is {conv.groups}, not 1"
    return None


def _short(node: object) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    args = ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in node.args[1:])
    if node.op == "call_method" and node.args:
        return f"{_short_arg(node.args[0])}.{node.target}({args})"
    if node.op in ("call_function", "call_module"):
        name = getattr(node.target, "__name__", str(node.target))
        every = ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in node.args)
        return f"{name}({every})"
    return f"{node.name} ({node.op})"


def _short_arg(arg: object) -> str:
    return arg.name if isinstance(arg, fx.Node) else repr(arg)


class PatchEmbeddingsFusion(FusionSpec):
    """``reshape(-1, C, T, P, P) -> Conv3d(kernel == stride) -> flatten(-1, D)`` → ``reshape -> Linear``."""

    target_modules_patterns = (r"(^|\.)patch_embed$",)
    no_match_message = (
        "The patch_embeddings fusion looks for a module whose forward reshapes its input to "
        "(-1, C, T, P, P), runs an nn.Conv3d child with kernel_size == stride, no padding, dilation 1 and "
        "groups 1, and flattens the result to (-1, D)."
    )
    # transformers' fusion_config={"patch_embeddings": True} gives the same fused layout
    # (linear_proj.weight), tests/interop/test_fusion_loading_interop.py.
    transformers_name = "patch_embeddings"

    # ------------------------------------------------------------------ structure
    def is_fusable(self, module: nn.Module) -> tuple[bool, str]:
        convs = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Conv3d)]
        if not convs:
            children = ", ".join(f"{n} ({type(c).__name__})" for n, c in module.named_children()) or "none"
            return False, f"{type(module).__name__} has no nn.Conv3d child (children: {children})"
        good = [n for n, c in convs if _conv_problem(c) is None]
        if good:
            return (
                True,
                f"Conv3d child(ren) {good} have kernel_size == stride, no padding, dilation 1, groups 1",
            )
        return False, "; ".join(f"Conv3d {n!r}: {_conv_problem(c)}" for n, c in convs)

    # ------------------------------------------------------------------ graph
    def find_matches(self, module: nn.Module, graph: fx.Graph) -> tuple[list[FusionMatch], str]:
        usable = {
            n for n, c in module.named_children() if isinstance(c, nn.Conv3d) and _conv_problem(c) is None
        }
        calls: dict[str, list[fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_module" and node.target in usable:
                calls.setdefault(str(node.target), []).append(node)
        if not calls:
            return [], f"forward never calls the fusable Conv3d child(ren) {sorted(usable)}"
        matches: list[FusionMatch] = []
        reasons: list[str] = []
        for name, nodes in calls.items():
            if len(nodes) > 1:
                reasons.append(f"Conv3d {name!r} is called {len(nodes)} times; only a single call is fused")
                continue
            found = self._match_call(module, graph, name, nodes[0])
            if isinstance(found, str):
                reasons.append(found)
            else:
                matches.append(found)
        return matches, "; ".join(reasons)

    def _match_call(
        self, module: nn.Module, graph: fx.Graph, name: str, call: fx.Node
    ) -> PatchEmbedMatch | str:
        conv = cast(nn.Conv3d, module._modules[name])  # find_matches only passes Conv3d children
        c_in, kernel, d_out = conv.in_channels, tuple(conv.kernel_size), conv.out_channels
        linear = f"linear_{name}"
        if linear in module._modules or linear in module.__dict__ or linear in module._parameters:
            return f"Conv3d {name!r}: the name {linear!r} for its replacement is already taken"
        if len(call.args) != 1 or call.kwargs:
            return f"Conv3d {name!r} is called with extra arguments: {call.format_node()}"
        src, _ = skip_passthrough_back(call)
        shape = reshape_shape(src) if isinstance(src, fx.Node) else None
        expected = (c_in, *kernel)
        patch = f"(-1, {', '.join(map(str, expected))})"
        if shape is None:
            what = src.format_node() if isinstance(src, fx.Node) else repr(src)
            return f"Conv3d {name!r} is not fed by a reshape to {patch}; its input comes from {what}"
        if len(shape) != 5 or tuple(shape[1:]) != expected:
            return f"Conv3d {name!r} is fed by {src.format_node()}, which is not a reshape to {patch}"
        if len(src.users) != 1:
            users = ", ".join(u.name for u in src.users)
            return f"the patch reshape {src.name!r} is also used by {users}; its shape would change"
        out = skip_passthrough_forward(call)
        if out is None or not flattens_to_width(out, d_out):
            what = out.format_node() if out is not None else f"{len(call.users)} user(s)"
            return f"Conv3d {name!r}'s output is not flattened to (-1, {d_out}); it goes to {what}"
        reads: list[str] = []
        for node, attr in child_reads(graph, name):
            if attr != "bias" and not (attr == "weight" and reads_only_metadata(node)):
                users = ", ".join(u.format_node() or u.name for u in node.users) or "nothing"
                return f"forward reads {node.target!r} in {users}; its value or shape differs in the fused layout"
            reads.append(node.name)
        bias = conv.bias is not None
        description = (
            f"Conv3d {name!r} ({c_in} -> {d_out} channels, kernel = stride = {kernel}, "
            f"{'with' if bias else 'no'} bias) between {_short(src)} and {_short(out)}"
        )
        return PatchEmbedMatch(
            description,
            (src.name, call.name, out.name),
            conv=name,
            linear=linear,
            in_channels=c_in,
            kernel_size=kernel,  # type: ignore[arg-type]
            out_channels=d_out,
            bias=bias,
            reshape=src.name,
            call=call.name,
            reads=tuple(reads),
        )

    def rewrite(
        self,
        module: nn.Module,
        graph: fx.Graph,
        matches: Sequence[FusionMatch],
        *,
        materialize: bool,
    ) -> GraphRewrite:
        nodes = {n.name: n for n in graph.nodes}
        new_modules: dict[str, nn.Module] = {}
        replaced: dict[str, str] = {}
        for m in matches:
            m = cast(PatchEmbedMatch, m)  # produced by find_matches above
            conv = cast(nn.Conv3d, module._modules[m.conv])
            new_modules[m.linear] = _linear_from(conv, m, materialize=materialize)
            replaced[m.conv] = m.linear
            reshape = nodes[m.reshape]
            lead = reshape_shape(reshape)[0]  # type: ignore[index]
            flat = m.in_channels * math.prod(m.kernel_size)
            src = reshape.args[0]
            reshape.args = (src, lead, flat) if reshape.op == "call_method" else (src, (lead, flat))
            call = nodes[m.call]
            with graph.inserting_before(call):
                new_call = graph.call_module(m.linear, call.args, call.kwargs)
            call.replace_all_uses_with(new_call)
            graph.erase_node(call)
            for read_name in m.reads:
                read = nodes[read_name]
                attr = str(read.target)[len(m.conv) + 1 :]
                with graph.inserting_before(read):
                    new_read = graph.get_attr(f"{m.linear}.{attr}")
                read.replace_all_uses_with(new_read)
                graph.erase_node(read)
        return GraphRewrite(new_modules, replaced)

    # ------------------------------------------------------------------ weights
    def make_transforms(
        self,
        path: str,
        module: nn.Module,
        matches: Sequence[FusionMatch] | None = None,
    ) -> list[WeightTransform]:
        """``proj.weight`` → ``linear_proj.weight`` (Conv3dToLinear) and ``proj.bias`` → ``linear_proj.bias``.

        In-channels and kernel size come from the matched conv; both transforms are scoped to
        ``path`` and anchored (``^proj\\.weight$``), so they touch this module's keys only.
        """
        if matches is None:
            graph, _ = trace_module(module)
            matches, _ = self.find_matches(module, graph)
        found = [m for m in matches if isinstance(m, PatchEmbedMatch)]
        renamings: list[WeightTransform] = [
            WeightRenaming(rf"^{re.escape(m.conv)}\.bias$", f"{m.linear}.bias", scope_prefix=path)
            for m in found
            if m.bias
        ]
        converters: list[WeightTransform] = [
            WeightConverter(
                rf"^{re.escape(m.conv)}\.weight$",
                f"{m.linear}.weight",
                [ops.Conv3dToLinear(m.in_channels, m.kernel_size)],
                scope_prefix=path,
            )
            for m in found
        ]
        return renamings + converters


def _linear_from(conv: nn.Conv3d, m: PatchEmbedMatch, *, materialize: bool) -> nn.Linear:
    """The Linear equivalent of ``conv`` on its device and dtype (``meta`` weights in a preview)."""
    weight = conv.weight
    flat = m.in_channels * math.prod(m.kernel_size)
    linear = nn.Linear(flat, m.out_channels, bias=m.bias, device="meta", dtype=weight.dtype)
    if materialize:
        op = ops.Conv3dToLinear(m.in_channels, m.kernel_size)
        (converted,) = op.convert([weight.detach()], ops.OpContext())
        new_w = cast(torch.Tensor, converted)  # one tensor in, one tensor out
        if new_w.data_ptr() == weight.data_ptr():
            new_w = new_w.clone()  # never alias the original module's storage
        new_b = conv.bias.detach().clone() if conv.bias is not None else None
    else:
        new_w = torch.empty((m.out_channels, flat), dtype=weight.dtype, device="meta")
        new_b = (
            torch.empty((m.out_channels,), dtype=weight.dtype, device="meta")
            if conv.bias is not None
            else None
        )
    linear.weight = nn.Parameter(new_w, requires_grad=weight.requires_grad)
    if new_b is not None and conv.bias is not None:
        linear.bias = nn.Parameter(new_b, requires_grad=conv.bias.requires_grad)
    linear.train(conv.training)
    return linear


FUSIONS: dict[str, type[FusionSpec]] = {"patch_embeddings": PatchEmbeddingsFusion}
"""Fusion name → spec class, registered by :func:`register`."""


def register(*, overwrite: bool = False) -> None:
    """Register this family's fusions through the public API (called by ``specs.register_catalog``)."""
    for name, spec_cls in FUSIONS.items():
        register_fusion(name, spec_cls(), overwrite=overwrite)
