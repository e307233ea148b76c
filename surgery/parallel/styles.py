"""The parallel styles this package adds to torch's, as ``ParallelStyle`` subclasses.

:class:`PackedColwiseParallel` is a ``ColwiseParallel`` for a fused projection of equal parts
(``gate_up_proj``, a ``qkv_proj`` of equal heads); :class:`ExpertsParallel` shards 3-D expert
tensors on their intermediate dim. :func:`style_for` turns a style name of a plan
(:data:`~surgery.parallel.STYLE_NAMES`) into the style instance that applies it.

Importing this module imports ``torch.distributed.tensor`` (about a second);
:mod:`surgery.parallel` imports it on first use of a style or of
:func:`~surgery.parallel.parallelize`.

Example:
    >>> from torch.distributed.tensor.parallel import ColwiseParallel
    >>> style = PackedColwiseParallel(split_factor=3)
    >>> isinstance(style, ColwiseParallel), style
    (True, PackedColwiseParallel(split_factor=3))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ..errors import ConfigurationError
from .experts import check_experts_module

__all__ = [
    "ExpertParallel",
    "ExpertsParallel",
    "PackedColwiseParallel",
    "PackedLinearParallel",
    "expert_placements",
    "strided_shard",
    "style_for",
    "sum_over_ranks",
]


def strided_shard(dim: int, split_factor: int) -> Any:
    """torch's private ``_StridedShard(dim, split_factor=...)``, the placement of a packed tensor's parts."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def expert_placements(name: str, split_factor: int) -> list[Any]:
    """The placements the ``experts`` style gives its parameter ``name`` (one per mesh dim)."""
    from torch.distributed.tensor import Shard

    if name == "gate_up_proj":
        return [strided_shard(1, split_factor)]
    if name == "down_proj":
        return [Shard(2)]
    raise ConfigurationError(
        f"the experts style shards 'gate_up_proj' (E, 2I, H) and 'down_proj' (E, H, I); {name!r} has no "
        "placement. Keep this module replicated, or give it a style of its own."
    )


class PackedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a fused projection of ``split_factor`` equal parts.

    Weight and bias are ``_StridedShard(0, split_factor)``: each rank holds its share of every
    part, side by side (``[G_r | U_r]`` for a ``gate_up_proj``). The output stays local: the
    inherited output hook would redistribute ``_StridedShard(-1)`` to ``Shard(-1)`` and
    reorder the features, which gives silently wrong results.

    Args:
        split_factor: the number of equal parts (2 for ``gate_up_proj``, 3 for ``qkv_proj``).
        **kwargs: ``ColwiseParallel``'s options.
    """

    def __init__(self, *, split_factor: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.split_factor = split_factor

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = strided_shard(0, self.split_factor)
            dist_param = nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dist_param)

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any
    ) -> Any:
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ConfigurationError(f"packed_colwise applies to nn.Linear, not {type(module).__name__}.")
        return super()._apply(module, device_mesh)

    def __repr__(self) -> str:
        return f"PackedColwiseParallel(split_factor={self.split_factor})"


class ExpertsParallel(ParallelStyle):
    """Expert tensors sharded on their intermediate dim; the output is all-reduced.

    ``gate_up_proj (E, 2I, H)`` is ``_StridedShard(1, 2)`` (each rank holds its share of the
    gate and the up rows of every expert) and ``down_proj (E, H, I)`` is ``Shard(2)``. A
    forward pre-hook swaps in the local shards so the module's own forward runs unchanged on
    them, and a forward hook puts the DTensors back and sums the partial outputs over the ranks.
    Training works as Megatron's tensor parallelism does: the floating inputs enter through an
    identity whose backward sums their gradients over the ranks (each rank's experts contribute
    part of them), and the output's sum passes its gradient through unchanged, so the replicated
    modules around the experts (the router, the norms) get the same gradient on every rank.

    Args:
        split_factor: the parts of ``gate_up_proj``'s intermediate dim (2: gate and up).
    """

    def __init__(self, *, split_factor: int = 2) -> None:
        super().__init__()
        self.split_factor = split_factor

    def _partition(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placements = expert_placements(pname, self.split_factor)
            module.register_parameter(
                pname,
                nn.Parameter(
                    distribute_tensor(param, device_mesh, placements, src_data_rank=self.src_data_rank),
                    requires_grad=param.requires_grad,
                ),
            )

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        distribute_module(module, device_mesh, self._partition)
        _LocalExperts(module, (device_mesh.get_group(),)).attach()
        return module

    def __repr__(self) -> str:
        return f"ExpertsParallel(split_factor={self.split_factor})"


class ExpertParallel(ParallelStyle):
    """Expert parallelism: each rank holds whole experts, ``Shard(0)`` of every 3-D expert tensor;
    on a 2-D ``(ep, tp)`` mesh each expert is also split over ``tp`` (expert-TP).

    On a 1-D mesh the experts' parameters (``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``,
    and 2-D expert biases ``(E, ...)``) are split on the expert dim: rank ``r`` of ``n`` owns
    experts ``r*E/n .. (r+1)*E/n - 1``. On a 2-D mesh (apply it with
    ``parallelize_module(experts, mesh["ep", "tp"], ExpertParallel())``) the first dim splits
    the experts the same way and the second splits each expert as the ``experts`` style does
    (``gate_up_proj`` ``_StridedShard(1, 2)``, ``down_proj`` ``Shard(2)``).

    Tokens are not moved: every rank computes, for all tokens, the contribution of its own
    experts (of its share of their intermediate dim under expert-TP; tokens routed elsewhere get
    the module's "no expert" id, its local expert count, which its loop skips), and the outputs
    are summed over the mesh. That costs one all-reduce of the hidden states per layer, as tensor
    parallelism does, instead of two all-to-alls of the routed tokens; the ranks of one expert
    group therefore see the same tokens, as tensor-parallel ranks do (docs/parallel.md measures
    it against an all-to-all dispatch). Gradients flow as with :class:`ExpertsParallel`.

    The module's forward takes ``(hidden_states, top_k_index, top_k_weights)`` (the examples' and
    transformers' Mixtral, Qwen2-MoE and Qwen3-MoE experts) and reads ``self.num_experts``.
    """

    def _partition(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        from torch.distributed.tensor import Shard

        for pname, param in list(module.named_parameters(recurse=False)):
            placements = [Shard(0)]
            if device_mesh.ndim == 2:
                placements += expert_placements(pname, 2)
            module.register_parameter(
                pname,
                nn.Parameter(
                    distribute_tensor(param, device_mesh, placements, src_data_rank=self.src_data_rank),
                    requires_grad=param.requires_grad,
                ),
            )

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        check_experts_module(module, f"ExpertParallel on {type(module).__name__}")
        if device_mesh.ndim not in (1, 2):
            raise ConfigurationError(
                f"expert_parallel takes a 1-D (ep) or 2-D (ep, tp) mesh, not {device_mesh.ndim}-D "
                f"{device_mesh.mesh_dim_names or ''}; pass mesh['ep'] or mesh['ep', 'tp']."
            )
        total = int(module.num_experts)  # type: ignore[arg-type]
        size = device_mesh.size(0)
        if total % size:
            raise ConfigurationError(
                f"expert_parallel: {total} experts do not split evenly over {size} ranks; use an expert-parallel "
                "size that divides the number of experts."
            )
        distribute_module(module, device_mesh, self._partition)
        per = total // size
        groups = tuple(device_mesh.get_group(d) for d in range(device_mesh.ndim))
        _OwnedExperts(module, groups, first=device_mesh.get_local_rank(0) * per, count=per).attach()
        return module

    def __repr__(self) -> str:
        return "ExpertParallel()"


class _LocalExperts:
    """The hooks that run an experts module on its local shards and all-reduce its output.

    The DTensors a forward swaps out are kept here, by the hooks' owner, not on the module.
    """

    def __init__(self, module: nn.Module, groups: tuple[Any, ...]) -> None:
        self.module = module
        self.groups = groups
        self.names = [n for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
        self.stash: dict[str, Any] = {}

    def attach(self) -> None:
        self.module.register_forward_pre_hook(self.swap_in)
        self.module.register_forward_hook(self.swap_out)

    def swap_in(self, mod: nn.Module, args: Any) -> tuple[Any, ...]:
        self.stash = {n: mod._parameters[n] for n in self.names}
        for n, p in self.stash.items():
            mod._parameters[n] = p.to_local()  # type: ignore[assignment, union-attr]
        return tuple(
            _GradientSum.apply(a, self.groups) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        )

    def swap_out(self, mod: nn.Module, args: Any, output: Any) -> Any:
        stash, self.stash = self.stash, {}
        for n, p in stash.items():
            mod._parameters[n] = p
        if isinstance(output, torch.Tensor):
            return _OutputSum.apply(output, self.groups)
        return output


class _OwnedExperts(_LocalExperts):
    """The hooks of :class:`ExpertParallel`: its experts' ids made local (the others the "no
    expert" id, the local count), their routing weights zeroed, ``num_experts`` the local count
    while the forward runs, the output summed over the ranks.

    transformers' experts implementations (``grouped_mm``, ``batched_mm``) skip an id at or past
    ``num_experts`` only when the module's ``_is_expert_parallel`` is set, and rely on its weight
    being zero: both are arranged for the forward and restored after it.
    """

    def __init__(self, module: nn.Module, groups: tuple[Any, ...], *, first: int, count: int) -> None:
        super().__init__(module, groups)
        self.first, self.count, self.total = first, count, int(module.num_experts)  # type: ignore[arg-type]
        self.flagged = hasattr(module, "_is_expert_parallel")
        self.flag = False

    def swap_in(self, mod: nn.Module, args: Any) -> tuple[Any, ...]:
        # the gradient sums wrap the inputs first and the masks go inside them: the backward masks
        # this rank's gradient, then sums. The other way round it would sum, then mask away the
        # other ranks' routing-weight gradients.
        args = super().swap_in(mod, args)
        ids = next((a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()), None)
        owned = None if ids is None else (ids >= self.first) & (ids < self.first + self.count)
        args = tuple(
            self._localized(a, owned) if isinstance(a, torch.Tensor) and owned is not None else a
            for a in args
        )
        setattr(mod, "num_experts", self.count)  # noqa: B010 (a module attribute, not a submodule)
        if self.flagged:
            self.flag = bool(getattr(mod, "_is_expert_parallel"))  # noqa: B009
            setattr(mod, "_is_expert_parallel", True)  # noqa: B010
        return args

    def _localized(self, t: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():  # the ids: local, or the "no expert" id
            return torch.where(owned, t - self.first, torch.full_like(t, self.count))
        if t.shape == owned.shape:  # the routing weights: zero for experts another rank owns
            return torch.where(owned, t, torch.zeros_like(t))
        return t

    def swap_out(self, mod: nn.Module, args: Any, output: Any) -> Any:
        setattr(mod, "num_experts", self.total)  # noqa: B010
        if self.flagged:
            setattr(mod, "_is_expert_parallel", self.flag)  # noqa: B010
        return super().swap_out(mod, args, output)


def _summed(x: torch.Tensor, groups: Any) -> torch.Tensor:
    """A copy of ``x`` summed over every group of ``groups`` (one group, or one per mesh dim)."""
    out = x.contiguous().clone()
    for group in groups if isinstance(groups, tuple) else (groups,):
        dist.all_reduce(out, group=group)
    return out


class _GradientSum(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the groups (an input every rank shares)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: Any) -> torch.Tensor:
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _summed(grad, ctx.groups), None


class _OutputSum(torch.autograd.Function):
    """The partial outputs summed over the groups; the gradient passes through (every rank has all of it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: Any) -> torch.Tensor:
        return _summed(x, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_ranks(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over the ranks of ``group`` (each holds a partial result); the gradient passes
    through unchanged (every rank has all of it)."""
    return _OutputSum.apply(x, group)


class PackedLinearParallel(ParallelStyle):
    """``colwise`` / ``rowwise`` for a linear that keeps its weight packed
    (:class:`~surgery.quantization.packed.PackedLinear`): its stored tensors are split where the
    format's layout splits them evenly (the packed words, the scale rows or groups), the rest is
    replicated, and each rank decodes its share per forward. The output follows torch's styles:
    a colwise output stays local, a rowwise output is summed over the ranks.

    Args:
        dim: the weight dim split: 0 (out-features, ``colwise``) or 1 (in-features, ``rowwise``).
    """

    def __init__(self, *, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module.shard(device_mesh, self.dim)  # type: ignore[operator]
        return module

    def __repr__(self) -> str:
        return f"PackedLinearParallel(dim={self.dim})"


def style_for(kind: str, module: nn.Module) -> ParallelStyle:
    """The style instance that applies the plan's style name ``kind`` to ``module``.

    Raises:
        ConfigurationError: ``kind`` is not one of the names a plan applies (``replicate`` applies
            nothing, so it has no style).
    """
    if kind in ("colwise", "rowwise") and callable(getattr(module, "tp_placements", None)):
        return PackedLinearParallel(dim=0 if kind == "colwise" else 1)  # a PackedLinear
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":  # an embedding takes whole token ids; a Linear the colwise output's shards
        return (
            RowwiseParallel(input_layouts=Replicate())
            if isinstance(module, nn.Embedding)
            else RowwiseParallel()
        )
    if kind == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if kind == "packed_colwise":
        return PackedColwiseParallel()
    if kind == "experts":
        return ExpertsParallel()
    if kind == "expert_parallel":
        return ExpertParallel()
    raise ConfigurationError(
        f"style {kind!r} has no ParallelStyle to apply; use one of colwise, rowwise, colwise_gather, "
        "packed_colwise, experts, expert_parallel."
    )
