"""How variants of one computation are timed against each other, on every rank.

Used by the benchmark (``python -m bench``, bench/harness.py) and by
``overlap_kernels.autotune`` (ops/autotune.py), so that a tuned choice is made
by the measurement the benchmark then reports. What is measured, and why:

- **Sustained**: each variant runs in blocks of calls back to back, as a
  model runs its layers; each call lies between two marks of a clock (CUDA
  events on the current stream; nothing waits between calls), read after the
  block. Once the queue is full a call's time is its device time, or its host
  time where the host cannot keep up: what a model sees. Calls timed one by
  one, each after an L2 flush, see device time only: at decode sizes, where a
  call's host time is its time, that can keep the candidate a model finds
  slower (docs/performance.md, "How to read the numbers").
- **Interleaved**: rounds of one block per variant, in an order rotated and
  reversed from round to round (:func:`round_orders`), so that drift (clocks,
  temperature, other work) falls on every variant alike and no variant always
  runs first or right after the same other one.
- **A barrier before each block**: the ranks start a block together, so a
  variant's collective does not wait for a rank still finishing the previous
  variant.
- **Inputs that leave L2**: where one call's inputs fit in L2, calls rotate
  through copies of them (:func:`n_input_sets`), so a call does not find its
  inputs where the previous call left them, as a layer's call would not.
- **Median per rank, then the maximum over ranks**: the median ignores the
  odd slow call; a tensor-parallel step takes as long as its slowest rank, and
  every rank gets the same numbers, so every rank makes the same choice.

Op-agnostic: variants are plain callables; warm-up (compiling, checking) is
the caller's.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

K = TypeVar("K", bound=Hashable)


class WallClock:
    """Host timer: for CPU runs and tests. GPU work is timed with :class:`CudaClock`."""

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, marks: list[tuple[Any, Any]]) -> list[float]:
        return [(b - a) * 1e3 for a, b in marks]


class CudaClock:
    """CUDA events on the current stream: no host sync between iterations, one at the end."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, marks: list[tuple[Any, Any]]) -> list[float]:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in marks]


def l2_bytes(device: torch.device) -> int:
    """The L2 cache of ``device`` in bytes; 0 on the CPU (no L2 to leave)."""
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0


def n_input_sets(bytes_per_set: int, l2_bytes: int, max_sets: int = 4) -> int:
    """How many input sets to rotate through so a call never finds its inputs in L2."""
    if l2_bytes <= 0 or bytes_per_set >= 2 * l2_bytes:
        return 1
    return min(max_sets, max(2, math.ceil(3 * l2_bytes / max(1, bytes_per_set))))


def clock_for(device: torch.device) -> CudaClock | WallClock:
    return CudaClock() if device.type == "cuda" else WallClock()


def call_marks(fn: Callable[[], Any], calls: int, clock: Any) -> list[tuple[Any, Any]]:
    """``calls`` calls of ``fn`` back to back, each between two marks of ``clock``
    (nothing waits between calls; ``clock.elapsed_ms`` reads them after)."""
    marks = []
    for _ in range(calls):
        t0 = clock.mark()
        fn()
        marks.append((t0, clock.mark()))
    return marks


def round_orders(names: Sequence[K], rounds: int) -> list[list[K]]:
    """Variant order per round: reversed every other round and rotated every two, so that no
    variant is always first nor always runs right after the same other variant (with three
    variants, six rounds visit all six orders)."""
    n = len(names)
    orders = [[names[(r // 2 + i) % n] for i in range(n)] for r in range(rounds)] if n else []
    return [o[::-1] if r % 2 else o for r, o in enumerate(orders)]


def time_calls(
    calls: Mapping[K, Callable[[], Any]],
    rounds: int,
    calls_per_round: int,
    clock: Any,
    barrier: Callable[[], None] = lambda: None,
    on_round: Callable[[int], None] | None = None,
) -> dict[K, list[float]]:
    """Per-call times (ms) on this rank of each of ``calls``: ``rounds`` rounds (orders from
    :func:`round_orders`) of one block of ``calls_per_round`` back-to-back calls per variant,
    ``barrier()`` before each block. Warm the calls up first: nothing here is left untimed."""
    samples: dict[K, list[float]] = {name: [] for name in calls}
    for r, order in enumerate(round_orders(list(calls), rounds)):
        for name in order:
            barrier()
            samples[name].extend(clock.elapsed_ms(call_marks(calls[name], calls_per_round, clock)))
        if on_round is not None:
            on_round(r)
    return samples


def medians(samples: Mapping[K, list[float]]) -> dict[K, float]:
    return {name: statistics.median(xs) for name, xs in samples.items() if xs}


def max_over_ranks(
    values: Mapping[K, float], reduce_max: Callable[[list[float]], list[float]] | None
) -> dict[K, float]:
    """Elementwise max over ranks; every rank must pass the same keys (same variants ran)."""
    names = sorted(values)
    if reduce_max is None:
        return dict(values)
    return dict(zip(names, reduce_max([values[n] for n in names])))


def torch_reduce_max(
    group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> Callable[[list[float]], list[float]] | None:
    """all_reduce(MAX) over ``group`` (None: the default group) of values held on ``device``
    (None: the current GPU, or the CPU without one); None when torch.distributed is not up
    or the group has one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    def reduce(xs: list[float]) -> list[float]:
        t = torch.tensor(xs, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()

    return reduce


def group_barrier(group: dist.ProcessGroup | None, device: torch.device) -> Callable[[], None]:
    """A barrier for :func:`time_calls`: this rank's GPU work done, then every rank of
    ``group`` there, then the barrier's own GPU work done (NCCL's barrier is a kernel);
    gloo and NCCL groups alike."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    several = dist.is_initialized() and dist.get_world_size(group) > 1

    def barrier() -> None:
        sync()
        if several:
            dist.barrier(group=group)
            sync()

    return barrier
