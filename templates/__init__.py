"""Hand-tunable templates: one TOML file per op with its knobs and tuned defaults.

Installed as ``overlap_kernels.templates``; read by ``overlap_kernels.tuning``.
"""
