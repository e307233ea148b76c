"""Loading: plan from headers, then read every tensor straight into place.

* :mod:`~surgery.load.plan`: :class:`LoadPlan` and :class:`PlanEntry` (with their :class:`Mode`
  and :class:`Status`), what a load will do.
* :mod:`~surgery.load.planner`: phase 1, from checkpoint headers to the work list, by the named
  steps of :mod:`~surgery.load.passes`; with :mod:`~surgery.model_state` (tensors, ties, configs,
  dtypes), :mod:`~surgery.load.shapes` (converter outputs on meta), :mod:`~surgery.load.sharding`
  (a tensor-parallel rank's part) and :mod:`~surgery.load.quantized` (a quantizer's steps);
  sources are read into destination views (:mod:`surgery.placement`, shared with saving).
* :mod:`~surgery.load.execute`: one entry of the work list, read and converted.
* :mod:`~surgery.load.staging`: the ring of host buffers a load to a device reads through.
* :mod:`~surgery.load.loader`: :func:`plan_load` and :func:`load_checkpoint` (phase 2).
* :mod:`~surgery.load.record`: what a load leaves in the model's record (:mod:`surgery.record`) for the save.
* :mod:`~surgery.load.report`: :class:`LoadReport`, everything a load did not do as asked.
"""

from .loader import DEFAULT_WORKERS, SYNC_ENV, load_checkpoint, plan_load
from .plan import LoadPlan, Mode, PlanEntry, Status
from .report import ConversionFailure, LoadReport, Mismatch

__all__ = [
    "DEFAULT_WORKERS",
    "SYNC_ENV",
    "ConversionFailure",
    "LoadPlan",
    "LoadReport",
    "Mismatch",
    "Mode",
    "PlanEntry",
    "Status",
    "load_checkpoint",
    "plan_load",
]
