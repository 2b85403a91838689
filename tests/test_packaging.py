"""`pip install .` ships every subpackage and the templates."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "overlap_kernels").rglob("__init__.py")
    }
    assert on_disk | {"overlap_kernels.templates"} == listed


def test_every_op_has_a_template_in_the_templates_package():
    import tomllib

    assert (ROOT / "templates" / "__init__.py").is_file()
    ops = {p.stem for p in (ROOT / "overlap_kernels" / "ops").glob("*.py")} - {
        "__init__",
        "autotune",
        "checks",
        "matmul",
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
