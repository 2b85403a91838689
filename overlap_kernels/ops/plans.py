"""signature -> plan -> launch: what a call does, decided once per signature.

A *signature* is everything an op's checks and choices read: the op, the
group (None read as the default group), the shapes, strides, dtypes and
devices of the operands, the config argument, a schedule and the op's flags.
Its *plan* is made on the signature's first call: every input check, the
config (defaults -> template -> tuned table -> caller; measured instead
inside :func:`overlap_kernels.autotune`), the path, the workspace and what
the launches need. A repeated call finds its plan in one LRU cache and runs it.
Choices are made from the signature alone (and, inside autotune, from a
measurement whose result every rank shares), so every rank of a group decides alike.

What a plan still checks on every call is what depends on the call's
tensors, not their signature: ``out`` (its shape, and overlap with the
inputs), the current device, whether a CUDA graph is being captured, and
operands whose base TMA cannot read (copied). reset_workspaces() forgets
every plan (plans hold workspaces).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
import torch.distributed as dist

from ..runtime.workspace import PlanCache, on_reset
from .checks import config_key

P = TypeVar("P")
# Signatures kept, the least recently used dropped past it: a server sees
# many batch sizes, each a signature, and must not grow it forever.
LIMIT = 512

_plans: PlanCache = PlanCache(LIMIT)
on_reset(_plans.clear)
# op -> plans made so far in this process: how tests see that a repeated call made none.
made: Counter = Counter()


LOCAL = "local"  # the group of an op that has none (matmul)


def signature(op: str, x, w, group, config, *flags: Hashable) -> tuple | None:
    """The signature of a call, or None where it has none (an operand that is
    not a tensor, a config that cannot be a key, no default group): such a
    call makes a plan of its own, which is not kept."""
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return None
    keyed = config_key(config) if config is not None else None
    if config is not None and keyed is None:
        return None
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return None
    return (op, group, x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device, keyed, *flags)


def plan_for(op: str, key: tuple | None, make: Callable[[], P]) -> P:
    """The plan of signature ``key``, made by ``make()`` on its first call."""
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        plan = make()
        made[op] += 1
        if key is not None:
            _plans[key] = plan
    return plan


def forget_plans() -> None:
    """Drop every plan (the next call of each signature makes its plan again)."""
    _plans.clear()
