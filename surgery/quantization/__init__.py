"""Quantizers on the load and save paths.

* :mod:`~surgery.quantization.protocol`: the :class:`Quantizer` hooks the loader and the save
  call (dequantize per source tensor before the op chain, quantize after it), checked.
* :mod:`~surgery.quantization.fp8`: :class:`FP8BlockQuantizer`, block-wise FP8 checkpoints
  (DeepSeek-V3 layout) decoded on read and re-encoded bit for bit on save.
* :mod:`~surgery.quantization.int8`: :class:`Int8WeightOnlyQuantizer`, int8 weight-only
  quantization on the fly into :class:`Int8WeightOnlyLinear`.
* :mod:`~surgery.quantization.gptq` / :mod:`~surgery.quantization.awq`: :class:`GPTQQuantizer`
  and :class:`AWQQuantizer`, int4 (GPTQ also 2/8-bit) checkpoints packed in int32 words.
* :mod:`~surgery.quantization.packed`: :class:`KeepPacked` keeps a stored-quantized checkpoint
  packed at runtime in :class:`PackedLinear` modules (and :class:`PackedModule` for experts) that
  decode per forward.
* :mod:`~surgery.quantization.kernels`: the FP8 block-scaled matmul a kept FP8 weight runs on a
  GPU that has one (else decode), and which kernel each quantized module runs (:func:`kernel_summary`).
* :mod:`~surgery.quantization.compressed_fp4`: :class:`CompressedFp4Quantizer`, compressed-tensors
  ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized`` decoded on read and saved back byte for byte.
* :mod:`~surgery.quantization.mxfp4`: :class:`Mxfp4Quantizer`, gpt-oss MXFP4 experts
  (``*_blocks``/``*_scales``) decoded on read and saved back byte for byte (bit-level FP4
  helpers in :mod:`~surgery.quantization.fp4`).
* :mod:`~surgery.quantization.compressed_tensors`: :class:`CompressedTensorsQuantizer`,
  compressed-tensors ``pack-quantized`` (int4/int8) and ``float-quantized`` (FP8) checkpoints.
* :mod:`~surgery.quantization.compressed_tensors_config`: the config groups of a compressed-tensors
  ``quantization_config`` (:class:`WeightScheme`, target matching).
* :mod:`~surgery.quantization.packing`: the int32 packing ``pack-quantized`` uses.
* :mod:`~surgery.quantization.choice`: a quantizer by name (``fp8``, ``int8``, ``auto`` from a
  checkpoint's ``config.json``), as the command line takes it, and from a ``quantization_config``
  (:func:`quantizer_from_config`, over the formats :func:`register_format` registered).

A runtime-layout save of a model quantized on the fly records its quantizer in the metadata
(:data:`QUANTIZATION_METADATA_KEY`); loading that checkpoint without a quantizer rebuilds it
(:func:`quantizer_from_metadata`), the way persisted fusions are re-applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigurationError, LoadError
from ..persist import metadata_json
from .awq import AWQ_ORDER, AWQ_REVERSE_ORDER, AWQQuantizer, awq_dequantize, awq_quantize
from .choice import (
    QUANTIZATION_CHOICES,
    checkpoint_config,
    config_formats,
    quantizer_by_name,
    quantizer_from_config,
    register_format,
    registered_formats,
)
from .compressed_fp4 import FP4_FORMATS, CompressedFp4Quantizer
from .compressed_tensors import FORMATS, CompressedTensorsQuantizer
from .fp8 import FP8BlockQuantizer, blockwise_dequantize, blockwise_quantize, expand_block_scales
from .gptq import GPTQQuantizer, gptq_dequantize, gptq_quantize, pack_words, unpack_words
from .int8 import Int8WeightOnlyLinear, Int8WeightOnlyQuantizer, int8_kernel_usable, quantize_per_channel
from .mxfp4 import Mxfp4Quantizer, mxfp4_dequantize
from .packed import INT4_GROUP_SIZES, KeepPacked, PackedLinear, PackedModule, int4_kernel_usable
from .packing import pack_int32, unpack_int32
from .protocol import (
    QUANTIZATION_METADATA_KEY,
    SMALL_COMPANION_BYTES,
    QuantizedModule,
    Quantizer,
    QuantizerHooks,
    bounded_repr,
    config_metadata,
)

__all__ = [
    "AWQ_ORDER",
    "AWQ_REVERSE_ORDER",
    "BUILTIN_QUANTIZERS",
    "INT4_GROUP_SIZES",
    "QUANTIZATION_CHOICES",
    "QUANTIZATION_METADATA_KEY",
    "SMALL_COMPANION_BYTES",
    "AWQQuantizer",
    "CompressedFp4Quantizer",
    "CompressedTensorsQuantizer",
    "FP8BlockQuantizer",
    "GPTQQuantizer",
    "Int8WeightOnlyLinear",
    "Int8WeightOnlyQuantizer",
    "KeepPacked",
    "Mxfp4Quantizer",
    "PackedLinear",
    "PackedModule",
    "QuantizedModule",
    "Quantizer",
    "QuantizerHooks",
    "awq_dequantize",
    "awq_quantize",
    "blockwise_dequantize",
    "blockwise_quantize",
    "checkpoint_config",
    "config_formats",
    "config_metadata",
    "expand_block_scales",
    "gptq_dequantize",
    "gptq_quantize",
    "int4_kernel_usable",
    "int8_kernel_usable",
    "mxfp4_dequantize",
    "pack_int32",
    "pack_words",
    "quantize_per_channel",
    "quantizer_by_name",
    "quantizer_from_config",
    "quantizer_from_metadata",
    "register_format",
    "registered_formats",
    "unpack_int32",
    "unpack_words",
]

# The formats quantizer_from_config chooses among (one line per format module).
register_format("fp8", FP8BlockQuantizer.from_config)
register_format(Int8WeightOnlyQuantizer.method, Int8WeightOnlyQuantizer.from_config)
register_format(CompressedTensorsQuantizer.method, CompressedTensorsQuantizer.from_config, formats=FORMATS)
register_format(GPTQQuantizer.method, GPTQQuantizer.from_config)
register_format(AWQQuantizer.method, AWQQuantizer.from_config)
register_format(CompressedFp4Quantizer.method, CompressedFp4Quantizer.from_config, formats=FP4_FORMATS)
register_format(Mxfp4Quantizer.method, Mxfp4Quantizer.from_config)

BUILTIN_QUANTIZERS: dict[str, Any] = {Int8WeightOnlyQuantizer.method: Int8WeightOnlyQuantizer}
"""``quant_method`` → quantizer class with ``from_config``, for checkpoints that persisted one."""


def quantizer_from_metadata(metadata: Mapping[str, str], *, source: str = "checkpoint") -> Any | None:
    """The quantizer a runtime-layout save persisted in ``metadata``, rebuilt; ``None`` if there is none.

    Raises:
        LoadError: the entry is not valid JSON, names a method no built-in quantizer has, or
            holds options that quantizer refuses (the message says to pass ``quantizer=``
            explicitly).
    """
    config = metadata_json(
        metadata, QUANTIZATION_METADATA_KEY, source=source, fix="pass quantizer= explicitly."
    )
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    cls = BUILTIN_QUANTIZERS.get(method) if isinstance(method, str) else None
    if cls is None:
        raise LoadError(
            f"{source} was saved quantized with quant_method={bounded_repr(method)} (metadata "
            f"{QUANTIZATION_METADATA_KEY!r}), which no built-in quantizer reads "
            f"({', '.join(sorted(BUILTIN_QUANTIZERS))}); pass quantizer= with the quantizer that wrote it."
        )
    try:
        return cls.from_config(config)
    except ConfigurationError as exc:
        raise LoadError(
            f"{source}: metadata {QUANTIZATION_METADATA_KEY!r} names {method!r} with options it refuses ({exc}); "
            "pass quantizer= explicitly."
        ) from None
