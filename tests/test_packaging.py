"""`pip install .` ships every subpackage and the templates."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_finder_ships_every_subpackage_and_the_templates():
    """pyproject's find rule, as setuptools applies it, takes every folder of
    overlap_kernels/ with an __init__.py, and the templates through the link
    overlap_kernels/templates -> ../templates."""
    from setuptools import find_packages

    rule = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(str(ROOT), include=rule["packages"]["find"]["include"]))
    link = ROOT / "overlap_kernels" / "templates"
    assert link.is_symlink() and link.resolve() == (ROOT / "templates").resolve()
    on_disk = {  # (followlinks: the templates' link, as the finder walks)
        ".".join(Path(folder).relative_to(ROOT).parts)
        for folder, _, files in os.walk(ROOT / "overlap_kernels", followlinks=True)
        if "__init__.py" in files
    }
    assert "overlap_kernels.templates" in on_disk and "overlap_kernels.ops.moe_details" in on_disk
    assert found == on_disk


def test_every_op_has_a_template_in_the_templates_package():
    import tomllib

    assert (ROOT / "templates" / "__init__.py").is_file()
    ops = {p.stem for p in (ROOT / "overlap_kernels" / "ops").glob("*.py")} - {
        "__init__",
        "autotune",
        "checks",
        "custom",  # (FusedOp: users' ops, configured by their code, not by a template)
        "gemm_ar_rmsnorm",  # (its knobs are its reduction's: all_reduce's template)
        "matmul",
        "moe_graph",  # (the MoE ops' graph mode: its config is moe's, from templates/moe.toml)
        "paths",
        "plans",
        "replay",
    }
    assert {p.stem for p in (ROOT / "templates").glob("*.toml")} == ops
    for op in ops:
        template = tomllib.loads((ROOT / "templates" / f"{op}.toml").read_text())
        assert {"cuda", "interpreter"} <= set(template), op


def test_importing_triton_first_on_cpu_is_a_clear_error():
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU the kernels are compiled: the import order does not matter")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", "import triton, overlap_kernels"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode != 0 and "Import overlap_kernels first" in proc.stderr
