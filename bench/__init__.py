"""The benchmarks: modules run from the repository's root as ``python -m bench.NAME``."""
