"""The benchmark scripts (the top floor): each runs as ``.venv/bin/python bench/NAME.py`` and prints
its figures for docs/BENCHMARKS.md and docs/benchmarks/; shared parts (bench.mesh_load) import
as ``bench.*``."""
