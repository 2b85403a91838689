"""Configs from four layers: heuristic defaults, the op's template, the tuned
table of the host, the caller.

Templates are TOML files in the repository's top-level ``templates/`` folder
(installed as ``overlap_kernels.templates``), one per op, with a comment on
every knob. Tuned tables hold values measured per host class (tuned.py).
Nothing here reads environment variables: what runs is what the template, the
tables in use and the caller say.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import torch

from .runtime.errors import OverlapInputError
from .runtime.platform import INTERPRETER
from .tuned import entry_matches as _matches  # one matching rule for templates and tuned tables
from .tuned import is_match_key as _is_match_key
from .tuned import lookup, table_generation

C = TypeVar("C")


_CHECKOUT = Path(__file__).resolve().parent.parent


@functools.cache
def load_template(op: str) -> dict[str, Any]:
    """The parsed template of ``op``: ``templates/<op>.toml`` of a source checkout
    (so edits there take effect at once), else the installed copy."""
    source = _CHECKOUT / "templates" / f"{op}.toml"
    if (_CHECKOUT / "pyproject.toml").is_file() and source.is_file():
        return tomllib.loads(source.read_text())
    return tomllib.loads(
        resources.files("overlap_kernels.templates").joinpath(f"{op}.toml").read_text()
    )


def shape_key(world: int, m: int, k: int, n: int, dtype: torch.dtype) -> dict[str, Any]:
    """What template entries match on: ``m`` is the total (gathered) M."""
    return {"world": world, "m": m, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch.")}


def template_values(op: str, shape: dict[str, Any]) -> dict[str, Any]:
    """Template fields for a call of ``op`` with ``shape`` (world, m, k, n, dtype)."""
    return dict(_template_values(op, tuple(sorted(shape.items()))))


@functools.lru_cache(maxsize=256)
def _template_values(op: str, shape_items: tuple) -> tuple:
    shape = dict(shape_items)
    template = load_template(op)
    section = template.get("interpreter" if INTERPRETER else "cuda", {})
    values = dict(template.get("common", {}))
    values.update({k: v for k, v in section.items() if k != "shapes"})
    for entry in section.get("shapes", []):
        if _matches(entry, shape):
            values.update({k: v for k, v in entry.items() if not _is_match_key(k, shape)})
            break
    return tuple(values.items())


def build_config(
    cls: type[C],
    op: str,
    shape: dict[str, Any],
    override: C | dict | None,
    device: torch.device | None = None,
) -> C:
    """Defaults -> template -> tuned table (where ``device`` is given) -> override.
    A whole config object is taken as it is."""
    if isinstance(override, cls):
        return override.validate()
    if override is None:
        return _default_config(cls, op, tuple(sorted(shape.items())), device, table_generation())
    if not isinstance(override, dict):
        raise OverlapInputError(
            f"config must be a {cls.__name__} or a dict of its fields, got {type(override).__name__}"
        )
    fields = {f.name for f in dataclasses.fields(cls)}
    values = template_values(op, shape)
    unknown = (set(values) | set(override)) - fields
    if unknown:
        raise OverlapInputError(
            f"unknown {cls.__name__} field(s) {sorted(unknown)}; fields are {sorted(fields)}"
        )
    tuned, table = lookup(op, shape, device) if device is not None else ({}, None)
    unknown = set(tuned) - fields
    if unknown:
        raise OverlapInputError(
            f"tuned table {table}: its [[{op}]] entry for {shape} has unknown {cls.__name__} "
            f"field(s) {sorted(unknown)}; fields are {sorted(fields)}"
        )
    values.update(tuned)
    values.update(override)
    try:
        return cls(**values).validate()
    except OverlapInputError as e:
        if not tuned:
            raise
        raise OverlapInputError(f"{e} (with {sorted(tuned)} from tuned table {table})") from e


@functools.lru_cache(maxsize=256)
def _default_config(cls, op: str, shape_items: tuple, device, generation: int):
    """The config of a call with no override: built once per shape and device
    (calls are hot), and again when the tables in use change (``generation``)."""
    return build_config(cls, op, dict(shape_items), {}, device)
