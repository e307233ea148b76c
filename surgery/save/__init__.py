"""Saving: back to the checkpoint layout a model was loaded from (or its runtime layout).

* :mod:`~surgery.save.saver`: :func:`save_checkpoint`, :func:`revert_state_dict`, :func:`iter_reverted`.
* :mod:`~surgery.save.inverse`: which transforms to invert (by the origin each has in the model's
  record), which reversed converter wins a runtime key, and the checkpoint name of each output.
* :mod:`~surgery.save.reverted`: :class:`RevertedState`, the tensors a save writes, computed one
  converter group at a time, in the loaded checkpoint's write order.
* :mod:`~surgery.save.quantized`: quantized modules back to floats, and the quantizer a model holds.
* :mod:`~surgery.save.distributed`: a parallel model's save shared out among its ranks (each
  assembles and writes its own files, rank 0 commits).
"""

from .inverse import reverting_transforms
from .reverted import QUANTIZATION_MODES, RevertedState, TensorSpec
from .saver import iter_reverted, revert_state_dict, save_checkpoint

__all__ = [
    "QUANTIZATION_MODES",
    "RevertedState",
    "TensorSpec",
    "iter_reverted",
    "revert_state_dict",
    "reverting_transforms",
    "save_checkpoint",
]
