"""Configs from three layers: heuristic defaults, the op's template, the caller.

Templates are TOML files in the repository's top-level ``templates/`` folder
(installed as ``overlap_kernels.templates``), one per op, with a comment on
every knob. Nothing here reads environment variables: what runs is what the
template and the caller say.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from .runtime.errors import OverlapInputError
from .runtime.platform import INTERPRETER

C = TypeVar("C")


_CHECKOUT = Path(__file__).resolve().parent.parent


@functools.cache
def load_template(op: str) -> dict[str, Any]:
    """The parsed template of ``op``: ``templates/<op>.toml`` of a source checkout
    (so edits there take effect at once), else the installed copy."""
    source = _CHECKOUT / "templates" / f"{op}.toml"
    if (_CHECKOUT / "pyproject.toml").is_file() and source.is_file():
        return tomllib.loads(source.read_text())
    return tomllib.loads(resources.files("overlap_kernels.templates").joinpath(f"{op}.toml").read_text())


def shape_key(world: int, m: int, k: int, n: int, dtype) -> dict[str, Any]:
    """What template entries match on: ``m`` is the total (gathered) M."""
    return {"world": world, "m": m, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch.")}


def _matches(entry: dict[str, Any], shape: dict[str, Any]) -> bool:
    """Keys of ``shape`` must be equal; ``<key>_max`` / ``<key>_min`` bound a key."""
    for key, value in shape.items():
        if key in entry and entry[key] != value:
            return False
        if f"{key}_max" in entry and value > entry[f"{key}_max"]:
            return False
        if f"{key}_min" in entry and value < entry[f"{key}_min"]:
            return False
    return True


def _is_match_key(key: str, shape: dict[str, Any]) -> bool:
    return key in shape or key.removesuffix("_max") in shape or key.removesuffix("_min") in shape


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


def build_config(cls: type[C], op: str, shape: dict[str, Any], override: C | dict | None) -> C:
    """Defaults -> template -> override. A whole config object is taken as it is."""
    if isinstance(override, cls):
        return override.validate()
    if override is None:
        return _default_config(cls, op, tuple(sorted(shape.items())))
    if not isinstance(override, dict):
        raise OverlapInputError(f"config must be a {cls.__name__} or a dict of its fields, got {type(override).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    values = template_values(op, shape)
    unknown = (set(values) | set(override)) - fields
    if unknown:
        raise OverlapInputError(f"unknown {cls.__name__} field(s) {sorted(unknown)}; fields are {sorted(fields)}")
    values.update(override)
    return cls(**values).validate()


@functools.lru_cache(maxsize=256)
def _default_config(cls, op: str, shape_items: tuple):
    """The config of a call with no override: built once per shape (calls are hot)."""
    return build_config(cls, op, dict(shape_items), {})


def memoized_for_default_config(resolve):
    """``resolve(x, w, group, config=None, **flags)`` cached for calls that pass
    no config, keyed by everything it reads (shapes, strides, dtypes, world
    size, flags): at decode sizes the host time of a call is its time."""
    cache: dict = {}

    @functools.wraps(resolve)
    def wrapper(x, w, group=None, config=None, **flags):
        if config is not None:
            return resolve(x, w, group, config, **flags)
        import torch.distributed as dist

        key = (tuple(x.shape), x.stride(), tuple(w.shape), w.stride(), x.dtype, w.dtype,
               dist.get_world_size(group), tuple(flags.items()))  # fmt: skip
        found = cache.get(key)
        if found is None:
            if len(cache) >= 256:  # shapes that vary call to call must not grow it forever
                cache.clear()
            found = cache[key] = resolve(x, w, group, None, **flags)
        return found

    return wrapper
