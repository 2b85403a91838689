"""`pip install .` ships every subpackage and the templates."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "overlap_kernels").rglob("__init__.py")
    }
    assert on_disk | {"overlap_kernels.templates"} == listed


def test_every_template_is_a_toml_file_of_the_templates_package():
    assert (ROOT / "templates" / "__init__.py").is_file()
    assert sorted(p.name for p in (ROOT / "templates").glob("*.toml")) == ["ag_gemm.toml"]
