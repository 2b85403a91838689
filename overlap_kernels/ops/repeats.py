"""Calls that repeat an earlier call's signature, sent straight to what it ran.

At decode sizes a call's host time is its time. On H200 x4
(bench/logs/probe_decode_x4_20261122T0730.log) enqueuing one gemm_ar call
took 42-75 us of host time by rank, as long as the plain pair's, while
one_shot's kernel runs in about 50: the slowest rank's host set the pace of
every rank. Most of that host time was the op finding out again what its
last call of the same signature found: the checks, the template's config, the
measured choice, the workspace and the plan.

A signature here is the group (``None`` read as the default group, so that a
repeat never outlives the process group it was made in), the shapes, strides,
dtypes and devices of x and w, and the config argument: what the checks, the
config and the choice are decided on. A call with no ``out`` and no schedule
whose path is final (not one timed in place while a measured choice settles,
ops/fastest.py; not one made while a CUDA graph is captured) leaves a
*repeat* for its signature: a callable ``repeat(x, w)`` that runs the same
path, or returns None where this call must take the op's full path after all
(the current device changed, a graph is being captured). The next call of
the signature is one key, one dict lookup and the repeat. What depends on
addresses (an operand TMA cannot read from its base is copied, as the full
path does) is handled by the repeat itself, alike on every rank.
reset_workspaces() forgets every repeat (they hold workspaces).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from ..runtime.workspace import PlanCache, on_reset
from .checks import config_key, operands_signature

Repeat = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]
# Signatures kept, the least recently used dropped past it: shapes that vary
# call to call (a decode batch of 1 to 64 rows, each measured with its
# candidates') must not grow it forever, nor empty it under a settling choice.
_LIMIT = 256


class Repeats:
    """One op's repeats by signature."""

    def __init__(self) -> None:
        self._repeats: PlanCache = PlanCache(_LIMIT)
        on_reset(self._repeats.clear)

    @staticmethod
    def key(x, w, group, config) -> Hashable | None:
        """The signature of a call (None where it has none: an operand that is
        not a tensor, a config that cannot be a key)."""
        if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
            return None
        keyed = config_key(config) if config is not None else None
        if config is not None and keyed is None:
            return None
        return (*operands_signature(x, w, group), keyed)  # group None once destroyed: keep() refuses it

    def get(self, key: Hashable | None) -> Repeat | None:
        return None if key is None else self._repeats.get(key)

    def keep(self, key: Hashable | None, repeat: Repeat) -> None:
        if key is not None and key[0] is not None:
            self._repeats[key] = repeat

