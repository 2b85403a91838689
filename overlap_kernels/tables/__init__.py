"""Shipped tuned tables: config values measured per host class (GPU, world size,
versions), one TOML file per class; read by ``overlap_kernels.tuned``, which
describes the format. ``python -m bench.tables_from_results`` writes the H200 ones.
"""
