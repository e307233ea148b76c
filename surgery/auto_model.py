"""A transformers model built from a checkpoint's ``config.json`` (``--model transformers:auto``).

The command line needs a module tree to load a checkpoint into. For a transformers checkpoint the
tree is described by its ``config.json``: :func:`transformers_model` reads it with
``AutoConfig``, takes the class its ``architectures`` entry names (the class that saved it, head
included), or ``AutoModel`` where that is absent or unknown to the installed transformers, and
builds it in the config's ``dtype`` under :func:`~surgery.init_empty`: parameters on ``meta`` (no
memory, no initialization), buffers computed, so the load fills in every weight.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from .empty import init_empty
from .errors import ConfigurationError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["TRANSFORMERS_AUTO", "transformers_model"]

TRANSFORMERS_AUTO = "transformers:auto"
"""The ``--model`` value that builds the model from the checkpoint's ``config.json``."""


def transformers_model(checkpoint: str | os.PathLike[str]) -> nn.Module:
    """The transformers model the ``config.json`` beside ``checkpoint`` describes, parameters on ``meta``.

    Args:
        checkpoint: a checkpoint directory, or a ``.safetensors`` file or index in it.

    Raises:
        ConfigurationError: transformers is not installed, there is no ``config.json``, or
            transformers cannot build a model from it (its message is quoted).

    Example:
        >>> model = transformers_model("checkpoints/llama")  # doctest: +SKIP
    """
    try:
        import transformers
    except ImportError:
        raise ConfigurationError(
            f"--model {TRANSFORMERS_AUTO} needs transformers, which is not installed: pip install "
            "'transformers>=5.20,<6', or give --model package.module:factory."
        ) from None
    path = Path(checkpoint)
    directory = path if path.is_dir() else path.parent
    if not (directory / "config.json").is_file():
        raise ConfigurationError(
            f"--model {TRANSFORMERS_AUTO}: no config.json in {directory}, so nothing says which model it "
            "is; copy the checkpoint's config.json there, or give --model package.module:factory."
        )
    try:
        config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
        names = getattr(config, "architectures", None) or []
        cls = getattr(transformers, names[0], None) if names else None
        with init_empty():
            # _from_config: the constructor transformers' Auto classes call, in the config's dtype
            model = (
                cls._from_config(config) if cls is not None else transformers.AutoModel.from_config(config)
            )
    except Exception as exc:  # whatever transformers raised about this config
        raise ConfigurationError(
            f"--model {TRANSFORMERS_AUTO}: transformers cannot build a model from {directory / 'config.json'} "
            f"({type(exc).__name__}: {str(exc)[:300]})."
        ) from None
    return model
