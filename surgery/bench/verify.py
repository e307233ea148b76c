"""Benchmark: ``surgery.verify`` against one load + save of the same checkpoint.

Run ``surgery bench verify [--hidden 512] [--layers 4] [--repeat 3]``. For the example MoE (expert
lists merged at load, split at save), the example dense model and the fused vision tower, it
writes an original-layout checkpoint into a temporary directory, then times (best of ``repeat``,
warm page cache) a ``load_checkpoint`` + ``save_checkpoint`` into a fresh model, and a
``verify`` (two loads into one model, two saves, the SHA-256 of the source's tensors and of the
runtime state after each load, and byte compares of the first save with the source and the
second save with the first). The ratio is expected near 2 plus the hashing.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from surgery.checkpoint import write_checkpoint
from surgery.examples import dense, moe, vision
from surgery.load.loader import load_checkpoint
from surgery.save import save_checkpoint
from surgery.verification import verify

from .harness import best_time, positive_int
from .harness import parser as bench_parser

__all__ = ["main", "run"]


def _cases(
    hidden: int, layers: int
) -> dict[str, tuple[Callable[[], nn.Module], dict[str, torch.Tensor], dict | None]]:
    moe_cfg = moe.ExampleMoEConfig(
        vocab_size=8 * hidden, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers
    )
    dense_cfg = dense.ExampleDenseConfig(
        vocab_size=8 * hidden, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers
    )
    return {
        "moe": (
            lambda: moe.build_moe_model(moe_cfg, seed=0),
            moe.original_state_dict(moe.build_moe_model(moe_cfg, seed=1)),
            None,
        ),
        "dense": (
            lambda: dense.build_dense_model(dense_cfg, seed=0),
            dense.original_state_dict(dense.build_dense_model(dense_cfg, seed=1)),
            None,
        ),
        "vision (fused)": (
            lambda: vision.build_vision_tower(seed=0),
            {k: v.clone() for k, v in vision.build_vision_tower(seed=1).state_dict().items()},
            {"patch_embeddings": True},
        ),
    }


def run(*, hidden: int = 512, layers: int = 4, repeat: int = 3) -> list[tuple[str, float, float, float]]:
    """Per case: (name, MiB, seconds of load + save, seconds of verify)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (factory, state, fusion) in _cases(hidden, layers).items():
            src = Path(tmp, name.split()[0])
            write_checkpoint(state, src)
            mib = sum(t.nbytes for t in state.values()) / 2**20
            del state

            def load_save(
                factory: Callable[[], nn.Module] = factory, src: Path = src, fusion: dict | None = fusion
            ) -> None:
                model = factory()
                load_checkpoint(model, src, fusion_config=fusion)
                save_checkpoint(model, Path(tmp, "out"))

            def audit(
                factory: Callable[[], nn.Module] = factory, src: Path = src, fusion: dict | None = fusion
            ) -> None:
                card = verify(factory, src, fusion_config=fusion)
                if not card.ok:
                    raise AssertionError(card.render())

            rows.append((name, mib, best_time(load_save, repeat), best_time(audit, repeat)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("verify", __doc__)
    parser.add_argument(
        "--hidden", type=positive_int, default=512, help="hidden size of the MoE and dense models"
    )
    parser.add_argument("--layers", type=positive_int, default=4, help="their layers")
    parser.add_argument("--repeat", type=positive_int, default=3, help="timed runs; the best counts")
    args = parser.parse_args(argv)
    print(f"{'model':<16} {'MiB':>7} {'load+save':>10} {'verify':>8} {'ratio':>6}")
    for name, mib, base, audit in run(hidden=args.hidden, layers=args.layers, repeat=args.repeat):
        print(f"{name:<16} {mib:7.1f} {base:9.3f}s {audit:7.3f}s {audit / base:6.2f}")


if __name__ == "__main__":
    main()
