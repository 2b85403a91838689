"""signature -> plan -> launch: what a call does, decided once per signature.

A *signature* is everything an op's checks and choices read: the op, the
group (None read as the default group), the shapes, strides, dtypes and
devices of the operands, the config argument, a schedule and the op's flags.
Its *plan* is made on the signature's first call: every input check, the
config (defaults -> template -> tuned table -> caller; measured instead
inside :func:`overlap_kernels.autotune`), the path, the workspace and what
the launches need. A repeated call finds its plan in one LRU cache and runs it.
Choices are made from the signature alone (and, inside autotune, from a
measurement whose result every rank shares), so every rank of a group decides
alike, given the same arguments; a new plan is compared across the group
before its first launch (:func:`agree`), so ranks called with different
shapes, dtypes, configs or schedules get an error naming what differs
instead of reading bytes their peers never wrote (the MoE ops that dispatch
tokens compare their word on every call instead, in the count exchange every
call makes: ``plan_for(meet=False)``). A repeated call pays no
host collective: its kernels' signals carry the plan's *signature word* (a
CRC of what the agreement compared), and a rank whose peer's call was
another (both made before, so no agreement met) gets OverlapMismatchError
from the wait that found the other word (runtime/signals.py).

What a plan still checks on every call is what depends on the call's
tensors, not their signature: ``out`` (its shape, and overlap with the
inputs), the current device, whether a CUDA graph is being captured, and
operands whose base TMA cannot read (copied). reset_workspaces() forgets
every plan (plans hold workspaces).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from ..runtime.errors import OverlapInputError, OverlapTimeoutError, signature_word
from ..runtime.meeting import PeerMissing, meet
from ..runtime.workspace import PlanCache, on_reset
from .checks import GemmKnobs, config_key

if TYPE_CHECKING:
    from .ag_gemm import AgGemmPlan
    from .gemm_ar import GemmArPlan
    from .gemm_rs import GemmRsPlan
    from .matmul import MatmulPlan
    from .moe import MoeConfig

P = TypeVar("P")
# Signatures kept, the least recently used dropped past it: a server sees
# many batch sizes, each a signature, and must not grow it forever.
LIMIT = 512

# One LRU per group: every rank of a group makes that group's plans in the same
# order, so each drops the same ones, and a dropped plan is made (and agreed on)
# again by every rank at once. A rank's plans of other groups, or of ops with no
# group (matmul, whose shapes may differ between ranks), never push them out.
_caches: dict[object, PlanCache] = {}
on_reset(_caches.clear)


def _cache(group) -> PlanCache:
    cache = _caches.get(group)
    if cache is None:
        cache = _caches[group] = PlanCache(LIMIT)
    return cache


# op -> plans made so far in this process: how tests see that a repeated call made none.
made: Counter = Counter()


LOCAL = "local"  # the group of an op that has none (matmul)


def signature(
    op: str,
    x: object,
    w: object,
    group: dist.ProcessGroup | str | None,
    config: GemmKnobs | dict | None,
    *flags: Hashable,
) -> tuple | None:
    """The signature of a call, or None where it has none (an operand that is
    not a tensor, a config that cannot be a key, no default group): such a
    call makes a plan of its own, which is not kept."""
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return None
    keyed = config_key(config) if config is not None else None
    if config is not None and keyed is None:
        return None
    if group is None:
        group = dist.group.WORLD  # (None where torch.distributed is not initialised)
        if group is None:
            return None
    return (
        op,
        group,
        x.shape,
        x.stride(),
        x.dtype,
        x.device,
        w.shape,
        w.stride(),
        w.dtype,
        w.device,
        keyed,
        *flags,
    )


def plan_for(
    op: str,
    key: tuple | None,
    make: Callable[[], P],
    shared: Callable[[tuple, P], dict] | None = None,
    *,
    meet: bool = True,
) -> P:
    """The plan of signature ``key``, made by ``make()`` on its first call and
    agreed on by the group (:func:`agree`) before it is kept. ``shared(key, plan)``
    says what every rank must have alike (default: a GEMM op's, :func:`gemm_shared`);
    ``key[1]`` is the group. The plan's ``word`` becomes the signature word of
    what the ranks share (a plan with no signature keeps word 0: unchecked).

    ``meet=False``: no agreement here; the op compares the plan's word across
    the group on every call itself (the MoE ops that dispatch tokens: in their
    count exchange, which every call makes, cached plan or new), so a rank that
    makes a new plan never waits in a meeting that its peers, finding theirs
    cached, skip. The plan keeps what its word stands for as ``plan.shared``
    (for naming what differs), and gets a word even without a signature."""
    # cached(key) and PlanCache.get, inlined: at decode sizes a call's host time is its time
    plan, cache = None, _caches.get(key[1]) if key is not None else None
    if cache is not None:
        try:
            cache.move_to_end(key)  # (the least recently used plan is dropped first)
            plan = cache[key]
        except KeyError:
            pass
    if plan is None:
        plan = make()
        made[op] += 1
        if key is not None or not meet:
            mine = (shared or gemm_shared)(key, plan)
            if meet:
                agree(op, key[1], mine, plan.cfg.timeout_s)
            else:
                plan.shared = mine
            plan.word = signature_word(op, mine)
            if key is not None:
                _cache(key[1])[key] = plan
    return plan


def gemm_shared(
    key: tuple, plan: AgGemmPlan | GemmRsPlan | GemmArPlan | MatmulPlan
) -> dict[str, str]:
    """What the ranks of a GEMM op's group must share: the shapes and dtypes of x
    and w, the op's flags and schedule, and the config the plan resolved (its path
    included). Strides and devices may differ."""
    _, _, x_shape, _, x_dtype, _, w_shape, _, w_dtype, _, _, *flags = key
    return {
        "x": described(x_shape, x_dtype),
        "w": described(w_shape, w_dtype),
        "flags and schedule": repr(tuple(flags)),
        "config": shared_config(plan.cfg),
    }


def described(shape: Sequence[int | str], dtype: torch.dtype) -> str:
    """A shape and dtype as the agreement compares and reports them."""
    return f"[{', '.join(str(d) for d in shape)}] {str(dtype).removeprefix('torch.')}"


def shared_config(cfg: GemmKnobs | MoeConfig) -> str:
    """A resolved config as the agreement compares it: every field but the
    deadline, which may differ (it only bounds each rank's own waits)."""
    return repr(
        {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "timeout_s"}
    )


def agree(
    op: str,
    group: dist.ProcessGroup | str,
    mine: dict[str, str],
    timeout_s: float,
    *,
    topic: str = "agree",
    done: str = "nothing was launched",
) -> None:
    """Compare ``mine`` (what every rank of ``group`` must have alike) across the
    group, within ``timeout_s``; OverlapInputError naming the first field that
    differs and a rank that differs, on every rank, before anything is launched.
    A rank whose peer does not arrive (absent, late, or calling a signature it
    had called before, so making no new plan) gets OverlapTimeoutError. Inside
    autotune(), the candidates are measured before this comparison (the plan's
    make() measures them). ``topic``: the meeting's (runtime/meeting.py);
    ``done``: what the error says the call did before it was refused."""
    if group == LOCAL or dist.get_world_size(group) == 1:
        return
    rank = dist.get_rank(group)
    try:
        posted = meet(group, topic, json.dumps(mine).encode(), timeout_s)
    except PeerMissing as missing:
        raise OverlapTimeoutError(op, rank, missing.peer, -1, None, timeout_s,
                                  where="agreement on a new call signature: it is absent, late, or called a signature it had called before") from None  # fmt: skip
    for peer, theirs in enumerate(json.loads(value) for value in posted):
        for field, value in mine.items():
            if theirs.get(field) != value:
                raise OverlapInputError(
                    f"{op}: the ranks of the group disagree on {field}: rank {rank} has {value}, rank {peer} "
                    f"has {theirs.get(field)}; every rank must call {op} with the same shapes, dtypes, config "
                    f"and schedule ({done})"
                )


def cached(key: tuple | None) -> Any:
    """The plan kept for signature ``key``, or None (none made, or dropped)."""
    return _cache(key[1]).get(key) if key is not None else None


def forget_plans() -> None:
    """Drop every plan (the next call of each signature makes its plan again)."""
    _caches.clear()
