"""Benchmarks: runnable timing scripts (not tests); each command module has ``run()`` and ``main()``.

Run them as ``surgery bench NAME [options]``. The parts:

* :mod:`~surgery.bench.harness`: the measuring tools they share (best-of timing, peak RSS, page
  cache, the fork server, tables and target lines); :func:`parser` gives each command the same
  program name and plain-text help, :func:`positive_int` refuses counts that would divide by zero,
  and :func:`best_time` times a call the same way everywhere.
* ``surgery bench load`` (:mod:`~surgery.bench.load`) runs seven cases, one module each:
  :mod:`~surgery.bench.load_throughput` (A), :mod:`~surgery.bench.load_per_key` (B),
  :mod:`~surgery.bench.save_time` (C), :mod:`~surgery.bench.parallel` (D: TP=2, and EP=4 on
  64 experts),
  :mod:`~surgery.bench.save_many_keys` (E), :mod:`~surgery.bench.distsave` (F) and
  :mod:`~surgery.bench.fsdp_load` (G), over the checkpoints of
  :mod:`~surgery.bench.checkpoints`, each load timed in a forked process by
  :mod:`~surgery.bench.load_variants`.
* ``route``, ``fusion``, ``graph``, ``io``, ``quantization``, ``verify`` (and ``generation``, part
  of ``fusion``): one module each; ``quantization`` runs the case of
  :mod:`~surgery.bench.quantization_formats` (GPTQ/AWQ against bf16) as its last part.
* ``planning`` (:mod:`~surgery.bench.planning`): header, routing and planning of a 500k-key
  per-expert FP8 index against case B, for one process and one expert-parallel rank.
* ``moe_dispatch`` (:mod:`~surgery.bench.moe_dispatch`): one expert-parallel MoE layer by
  ``expert_parallel``'s all-reduce and by an all-to-all token dispatch, on gloo ranks.
* ``gpu`` (:mod:`~surgery.bench.gpu`): the prepared run for a GPU machine: loads into device
  memory against safetensors and transformers, exactness, the FP8 runtime, fusions; checked on
  the CPU at tiny scale.
"""

from .harness import best_time, parser, positive_int

__all__ = ["best_time", "parser", "positive_int"]
