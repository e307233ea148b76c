"""Benchmarks: runnable timing scripts (not tests); each module has ``run()`` and ``main()``."""

__all__: list[str] = []
