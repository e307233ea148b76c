"""What an experts module must hold for expert parallelism (a leaf module: no ``torch.distributed``).

:func:`check_experts_module` is the one check :func:`~surgery.parallel.resolve_tp_plan` (a plan's
``expert_parallel``) and :class:`~surgery.parallel.styles.ExpertParallel` (``parallelize_module``
by hand) share: the experts as ``(E, ...)`` parameters with ``num_experts = E`` on the module.

Example:
    >>> from surgery.examples import moe
    >>> model = moe.build_moe_model(moe.ExampleMoEConfig(num_local_experts=8), device="meta")
    >>> check_experts_module(model.model.layers[0].mlp.experts, "experts")  # 8 rows in every parameter
"""

from __future__ import annotations

from torch import nn

from ..errors import ConfigurationError

__all__ = ["check_experts_module"]


def check_experts_module(module: nn.Module, where: str) -> None:
    """Refuse ``expert_parallel`` on a module that does not hold its experts as ``(E, ...)`` parameters
    with ``num_experts = E`` (``where`` names the module in the message).

    Raises:
        ConfigurationError: naming the module's ``num_experts`` and parameter shapes.
    """
    params = dict(module.named_parameters(recurse=False))
    experts = getattr(module, "num_experts", None)
    if (
        not isinstance(experts, int)
        or not params
        or any(p.dim() < 2 or p.shape[0] != experts for p in params.values())
    ):
        raise ConfigurationError(
            f"{where}: expert_parallel shards experts stored as 3-D parameters (E, ...) with num_experts = E "
            f"on the module; this one has num_experts={experts!r} and parameters "
            f"{ {n: tuple(p.shape) for n, p in params.items()} }. Apply it to the experts module (mlp.experts)."
        )
