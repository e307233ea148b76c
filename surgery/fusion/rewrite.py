"""The fx rewrite engine: trace one candidate alone, let a spec rewrite it, build the replacement.

* :func:`~surgery.fusion.tracing.trace_module` traces the candidate alone (every child a leaf)
  and leaves it untouched.
* :func:`examine_candidate` runs one spec on one candidate and returns the plan entry plus the
  replacement module, built entirely on the side (the model is never touched here).
* :class:`FusedModule` is the replacement: a :class:`torch.fx.GraphModule` named ``Fused`` + the
  original class name, holding the original's children (the fused ones replaced), parameters,
  buffers and public attributes, on the original's device and dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from typing import Any

from torch import fx, nn

from ..errors import FusionError
from .plan import SKIPPED, WOULD_FUSE, FusionCandidate, GraphSnapshot, tensor_summaries
from .spec import FusionSpec, GraphRewrite
from .tracing import SELF_ATTRIBUTE, optional_arguments, reads_training, trace_module
from .variants import Variant, VariantTable, every_variant

__all__ = ["NOTHING_HERE", "NO_MATCH", "FusedModule", "build_fused_module", "examine_candidate"]

NO_MATCH = "no match: "
"""How a plan entry's reason starts when the candidate traced but its graph holds no match."""

NOTHING_HERE = "nothing to fuse: "
"""How a spec that searches everywhere starts its no-match reason when the pattern is simply not in
the graph (as opposed to being there and refused); ``strict=True`` does not raise for those."""

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _variant_traces(module: nn.Module, graph: fx.Graph, constants: dict[str, Any]) -> dict[Variant, fx.Graph]:
    """The graph of every other case ``module``'s forward branches on (the other mode when it reads
    ``self.training``; each optional state argument given or ``None``), traced as ``graph`` was.
    Cases whose code equals ``graph``'s are left out; the module's mode is put back."""
    optional = optional_arguments(module)
    training = reads_training(module)
    if not optional and not training:
        return {}
    main_src = graph.python_code(root_module="self").src
    out: dict[Variant, fx.Graph] = {}
    for variant in every_variant(training=module.training, reads_training=training, optional=optional)[1:]:
        other, other_constants = trace_module(module, variant=variant)
        if set(other_constants) - set(constants):
            raise FusionError(
                f"its graphs for {variant} and the default case read different tensor constants"
            )
        if other.python_code(root_module="self").src != main_src:
            out[variant] = other
    return out


def module_hooks(module: nn.Module) -> list[str]:
    """Names of the hook dicts of ``module`` that are not empty (a rewrite would drop them)."""
    return [name.strip("_") for name in _HOOK_DICTS if getattr(module, name, None)]


class FusedModule(fx.GraphModule):
    """A module rewritten by a fusion.

    A :class:`torch.fx.GraphModule` whose class name is ``Fused`` + the original class name,
    with the original's children (fused ones replaced), parameters, buffers and public
    attributes. ``fusion_name`` (the latest), ``fusion_names`` (every fusion applied, in order)
    and ``original_class`` say where it came from. Deep copies keep
    all of this.
    """

    fusion_name: str
    fusion_names: tuple[str, ...]
    original_class: type

    @property
    def surgery_self(self) -> FusedModule:
        """The module itself, for graphs that pass ``self`` to a leaf function (``attention(self, ...)``)."""
        return self

    @surgery_self.setter
    def surgery_self(self, value: object) -> None:
        pass  # GraphModule copies every get_attr target; this one always answers with the module

    def set_variants(self, graphs: dict[Variant, fx.Graph], *, reads_training: bool) -> None:
        """Keep one graph per case the forward branches on (the first: the default case, which is
        :attr:`graph`); each call runs the forward of its case (see :mod:`surgery.fusion.variants`)."""
        table = VariantTable.build(graphs, class_name=type(self).__name__, reads_training=reads_training)
        object.__setattr__(self, "_variants", table)
        type(self).forward = _forward_of_its_case  # type: ignore[method-assign]

    @property
    def variants(self) -> VariantTable | None:
        """The graph and forward of every case, or ``None`` when the forward has one case only."""
        return self.__dict__.get("_variants")

    def forward_for(self, variant: Variant) -> Callable[..., Any]:
        table = self.variants
        if table is None:
            return type(self).forward  # type: ignore[no-any-return]
        return table.forwards[variant]

    def optional_arguments(self) -> tuple[str, ...]:
        table = self.variants
        return tuple(name for name, _ in table.slots) if table is not None else ()

    def reads_training(self) -> bool:
        table = self.variants
        return table is not None and table.reads_training

    def recompile(self) -> Any:
        code = super().recompile()
        # GraphModule installs the code of ``graph`` as the forward of this instance's own class;
        # with several cases, a forward that picks the case of each call takes its place.
        if self.__dict__.get("_variants") is not None:
            type(self).forward = _forward_of_its_case  # type: ignore[method-assign]
        return code

    def train(self, mode: bool = True) -> FusedModule:
        super().train(mode)
        table = self.variants
        graph = table.graph_for(Variant(mode)) if table is not None and table.reads_training else None
        if graph is not None and graph is not self.graph:
            self.graph = graph  # what ``code`` and ``graph`` show follows the mode
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # torch.fx pickles the generated code of ``graph`` only: the default case. The compiled
        # forwards of the other cases do not pickle; the unpickled module checks, as torch.fx
        # does, that it is called in the default case.
        rebuild, (body, imports) = super().__reduce__()
        body.pop("_variants", None)
        return rebuild, (body, imports)

    def __deepcopy__(self, memo: dict[int, Any]) -> FusedModule:
        res = super().__deepcopy__(memo)
        res.__class__.__name__ = type(self).__name__  # GraphModule.__init__ resets it
        for key in self.__dict__.get("_fusion_attrs", ()):
            object.__setattr__(res, key, copy.deepcopy(self.__dict__[key], memo))
        object.__setattr__(res, "_fusion_attrs", self.__dict__.get("_fusion_attrs", ()))
        res._non_persistent_buffers_set = set(self._non_persistent_buffers_set)
        table = self.variants
        if table is not None:
            # The compiled forwards take the module as ``self``: the copy shares them; it owns
            # copies of the graphs (its own ``graph`` for the case that is the original's).
            graphs = {
                v: res.graph if g is self.graph else copy.deepcopy(g, memo) for v, g in table.graphs.items()
            }
            object.__setattr__(res, "_variants", dataclasses.replace(table, graphs=graphs))
            res.recompile()
        return res  # type: ignore[return-value]


def _forward_of_its_case(self: FusedModule, *args: Any, **kwargs: Any) -> Any:
    """The forward of a fused module with several cases: run the code of the case this call is."""
    return self.__dict__["_variants"].select(self.training, args, kwargs)(self, *args, **kwargs)


_PLAIN = (int, float, str, bool, type(None), tuple, frozenset)


def _public_attributes(module: nn.Module) -> dict[str, Any]:
    """The instance's public attributes, then plain class-level values of its class and bases
    (``is_causal = False`` on a class: a leaf attention kernel reads it from the module)."""
    reserved = set(dir(FusedModule))
    out = {
        k: v
        for k, v in module.__dict__.items()
        if not k.startswith("_") and k != "training" and k not in reserved
    }
    if isinstance(module, FusedModule):
        return out
    for klass in type(module).__mro__:
        if klass is nn.Module or not issubclass(klass, nn.Module):
            break
        for k, v in vars(klass).items():
            if not k.startswith("_") and k not in reserved and k not in out and isinstance(v, _PLAIN):
                out[k] = v
    return out


def build_fused_module(
    module: nn.Module,
    graph: fx.Graph,
    rewrite: GraphRewrite,
    constants: dict[str, Any],
    *,
    class_name: str,
    fusion: str,
) -> FusedModule:
    """Assemble the replacement for ``module`` from a rewritten ``graph`` (``module`` is not touched).

    Children keep their order, with each replaced child's successor in its place; parameters,
    buffers (persistence included) and public attributes are carried over; tensor constants
    become non-persistent buffers, so they follow ``.to()`` and stay out of the ``state_dict``.
    """
    children: dict[str, nn.Module | None] = {}
    for name, child in module._modules.items():
        if name in rewrite.removed:
            continue
        if name in rewrite.replaced:
            new_name = rewrite.replaced[name]
            children[new_name] = rewrite.new_modules[new_name]
        else:
            children[name] = child
    for name, child in rewrite.new_modules.items():
        children.setdefault(name, child)
    # Plain (non-parameter, non-buffer) attributes the graph reads, e.g. a tensor kept as ``self.scale``.
    plain = {
        atom: module.__dict__[atom]
        for node in graph.nodes
        if node.op == "get_attr"
        for atom in [str(node.target).split(".")[0]]
        if atom not in constants and atom in module.__dict__
    }
    holder = nn.Module()
    for name, child in children.items():
        holder._modules[name] = child
    for name, p in module._parameters.items():
        holder._parameters[name] = p
    for name, b in module._buffers.items():
        holder._buffers[name] = b
    for name, value in {**plain, **constants}.items():
        object.__setattr__(holder, name, value)
    object.__setattr__(holder, SELF_ATTRIBUTE, holder)

    fused = FusedModule(holder, graph, class_name)
    # GraphModule copies only what the graph references (and may leave empty stand-ins on the way
    # to a dotted get_attr); install the full set, in the original order, instead.
    fused._modules.clear()
    fused._modules.update(children)
    fused._parameters.clear()
    fused._parameters.update(module._parameters)
    fused._buffers.clear()
    fused._buffers.update(module._buffers)
    fused._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    for name, value in constants.items():
        fused.__dict__.pop(name, None)
        fused.register_buffer(name, value, persistent=False)
    fused.training = module.training
    attrs = {**_public_attributes(module), **plain}
    for k, v in attrs.items():
        object.__setattr__(fused, k, v)
    earlier = tuple(getattr(module, "fusion_names", ())) if isinstance(module, FusedModule) else ()
    object.__setattr__(fused, "fusion_name", fusion)
    object.__setattr__(fused, "fusion_names", (*earlier, fusion))
    object.__setattr__(
        fused, "original_class", module.original_class if isinstance(module, FusedModule) else type(module)
    )
    object.__setattr__(fused, "_fusion_attrs", (*attrs, "fusion_name", "fusion_names", "original_class"))
    return fused


def examine_candidate(
    fusion: str,
    spec: FusionSpec,
    path: str,
    module: nn.Module,
    *,
    materialize: bool,
) -> tuple[FusionCandidate, FusedModule | None]:
    """Run ``spec`` on one candidate: check, trace, match, rewrite, build the replacement.

    Nothing here touches ``module`` or the model; the caller swaps the replacement in.

    Returns:
        ``(plan entry, replacement)``; the replacement is ``None`` when the candidate is skipped
        (the entry's ``reason`` says why).

    Raises:
        FusionError: the spec matched but its rewrite failed (a bug in the spec; the message names
            the path and the fusion).
    """
    cls = type(module).__name__
    entry = FusionCandidate(fusion, path, cls, SKIPPED, "", params_before=tensor_summaries(module))
    ok, why = spec.is_fusable(module)
    if not ok:
        entry.reason = f"not fusable: {why}"
        return entry, None
    if not path:
        entry.reason = (
            "the root module cannot be replaced in place; apply the fusion to a model that contains it"
        )
        return entry, None
    hooks = module_hooks(module)
    if hooks:
        entry.reason = (
            f"has {', '.join(hooks)} registered on the instance, which a replacement would drop; "
            "remove them, or apply the fusion before registering hooks"
        )
        return entry, None
    try:
        graph, constants = trace_module(module)
        others = _variant_traces(module, graph, constants)
    except FusionError as exc:
        entry.reason = f"untraceable: {exc}"
        return entry, None
    entry.before = GraphSnapshot.of(graph)
    matches, reason = spec.find_matches(module, graph)
    if not matches:
        entry.reason = f"{NO_MATCH}{reason}"
        return entry, None
    other_matches: dict[Variant, list[Any]] = {}
    for variant, other in others.items():
        found, _ = spec.find_matches(module, other)
        if [(type(m), m.description) for m in found] != [(type(m), m.description) for m in matches]:
            entry.reason = (
                f"untraceable: the pattern differs between the default case and {variant} (its forward "
                "branches on the mode or on an optional state argument such as a cache); fuse a module "
                "whose forward does the same projections in every case"
            )
            return entry, None
        other_matches[variant] = found
    try:
        transforms = spec.make_transforms(path, module, matches)
        rewrite = spec.rewrite(module, graph, matches, materialize=materialize)
        graph.lint()
        fused = build_fused_module(
            module, graph, rewrite, constants, class_name=spec.fused_class_name(module), fusion=fusion
        )
        if others:
            for variant, other in others.items():
                spec.rewrite(module, other, other_matches[variant], materialize=False)  # the graph only
                other.lint()
            fused.set_variants(
                {Variant(module.training): fused.graph, **others}, reads_training=reads_training(module)
            )
    except FusionError:
        raise
    except Exception as exc:
        exclude = {fusion: {"exclude": ["^" + re.escape(path) + "$"]}}
        raise FusionError(
            f"Fusion {fusion!r} matched {path!r} ({cls}) but its rewrite failed: {type(exc).__name__}: {exc}. "
            f"The model was left unchanged; skip this module with {exclude!r} and report the failure."
        ) from exc
    entry.status = WOULD_FUSE
    entry.reason = "; ".join(m.description for m in matches)
    entry.fused_class_name = type(fused).__name__
    entry.after = GraphSnapshot.of(fused.graph, code=fused.code)
    entry.params_after = tensor_summaries(fused)
    entry.transforms = tuple(transforms)
    return entry, fused
