"""Calls that repeat an earlier call's signature, sent straight to what it ran.

At decode sizes a call's host time is its time. On H200 x4
(bench/logs/probe_decode_x4_20261122T0730.log) enqueuing one gemm_ar call
took 42-75 us of host time by rank, as long as the plain pair's, while
one_shot's kernel runs in about 50: the slowest rank's host set the pace of
every rank. Most of that host time was the op finding out again what its
last call of the same signature found: the checks, the template's config, the
measured choice, the workspace and the plan.

A signature here is what every one of those depends on: the group, the
shapes, strides, dtypes and devices of x and w, and the config argument.
A call with no ``out`` and no schedule whose path is final (not one timed in
place while a measured choice settles, ops/fastest.py; not one made while a
CUDA graph is captured) leaves a *repeat* for its signature: a callable
``repeat(x, w)`` that runs the same path, or returns None where this call
must take the op's full path after all (its operands are not aligned as the
first call's were, the current device changed, a graph is being captured,
the workspace was reset). The next call of the signature is one key, one
dict lookup and the repeat.

What a repeat skips is what its signature settles: input checks of shapes,
strides, dtypes and devices, the config, the choice. What depends on
addresses or state is still checked by the repeat itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from .checks import config_key

Repeat = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]
_LIMIT = 256  # signatures kept: shapes that vary call to call must not grow it forever


class Repeats:
    """One op's repeats by signature."""

    def __init__(self) -> None:
        self._repeats: dict[Hashable, Repeat] = {}

    @staticmethod
    def key(x, w, group, config) -> Hashable | None:
        """The signature of a call (None where it has none: an operand that is
        not a tensor, a config that cannot be a key)."""
        if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
            return None
        keyed = config_key(config) if config is not None else None
        if config is not None and keyed is None:
            return None
        return (group, x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device, keyed)

    def get(self, key: Hashable | None) -> Repeat | None:
        return None if key is None else self._repeats.get(key)

    def keep(self, key: Hashable | None, repeat: Repeat) -> None:
        if key is None:
            return
        if len(self._repeats) >= _LIMIT:
            self._repeats.clear()
        self._repeats[key] = repeat

    def clear(self) -> None:
        self._repeats.clear()


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` captures a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
