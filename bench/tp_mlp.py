"""Benchmark entry for a tensor-parallel MLP block: one training step's forward and backward.

The block is ``nn.Sequential(Linear(H, F), SiLU(), Linear(F, H))`` (no bias), parallelized
over the group by ``parallelize_module`` with sequence parallelism: each rank holds its
tokens ``[T/world, H]`` and gets its tokens of the output; the up projection is sharded by
rows of its weight (colwise, input ``Shard(0)``), the down projection by columns (rowwise,
output ``Shard(0)``). A timed step: gradients cleared (``set_to_none``, as a training loop
does), forward, the loss ``0.5 * sum(y**2)`` over this rank's tokens (fp32), backward
(weights and the input: 2 GEMMs forward, 4 backward), and a wait on the input gradient's
reduce-scatter (torch's eager styles leave it in flight). The optimizer is not part of it.

    cublas                 the same 6 GEMMs and the activation on one rank's weight shards and
                           the gathered [T, H] tokens, no communication   (compute alone)
    nccl_collectives       2 all-gathers and 2 reduce-scatters of [T, H] (communication alone:
                           what torch's styles send, forward and backward)
    torch                  torch's ColwiseParallel(input_layouts=Shard(0)) +
                           RowwiseParallel(output_layouts=Shard(0)): DTensor, NCCL, cuBLAS
    ours                   overlap_kernels.integrations.dtensor's OverlapColwiseParallel +
                           OverlapRowwiseParallel: ag_gemm then gemm_rs, and in backward
                           gemm_rs (dx) and ag_gemm (dh); the gathered x is kept for dW_up
    ours_regather          ``ours`` keeping x alone (``keep_gathered=False``): x is gathered
                           again for dW_up beside the dx product, dx reduce-scattered beside it
    torch_compiled         ``torch`` under torch.compile(fullgraph=True) (Inductor)
    ours_compiled          ``ours`` under torch.compile(fullgraph=True) (Inductor)
    torch_compiled_routed  ``torch_compiled`` with overlap_kernels.integrations.inductor's pass:
                           the gathers and reduce-scatters around the matmuls become our ops
    bound                  max(cublas, nccl_collectives): perfect overlap (computed)

The pass is scoped to ``torch_compiled_routed``: ``inductor.enable`` is given a namespace of its
own, and the pass reaches Inductor through that variant's ``torch.compile(options=...)``, so
``torch_compiled`` stays torch's. Before timing, every variant's loss, output, input gradient
and both weight-gradient shards are compared with a reference computed from the gathered
inputs (fp32 on GPU, fp64 on CPU): the largest relative Frobenius error of the five, max over
ranks, must be below ``Settings.rel_tol``. FLOPs per rank: 6 GEMMs of 2 T H F/world each.
Shapes ``TxHxF`` (T total tokens) or a preset; T and F must divide by the number of ranks.
bf16 on GPUs; float32 on CPU ranks (a smoke of the harness: Triton's interpreter, gloo).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from bench.common import (
    Check,
    check_variants,
    cycled,
    generator,
    input_sets,
    measure,
    rel_frobenius,
    run_shapes,
    unavailable,
)
from bench.harness import RunContext, Settings, Variant, geomean, shape_str, speedup
from bench.report import Progress, grid

OP = "tp_mlp"
DTYPE = torch.bfloat16  # on GPUs; CPU ranks run float32 (dtype_for)
SHAPE_KEYS = ("T", "H", "F")  # total tokens, hidden, FFN width
PRESETS = {  # hidden and FFN width of Llama-3 (whose MLP is gated; this block is not)
    "llama3_8b_t4096": (4096, 4096, 14336),
    "llama3_8b_t8192": (8192, 4096, 14336),
    "llama3_70b_t4096": (4096, 8192, 28672),
    "llama3_70b_t8192": (8192, 8192, 28672),
}
DEFAULT_SHAPES: list[tuple[int, ...]] = list(PRESETS.values())
# A smoke on GPUs: one shape of each model (cli.py's --quick cuts iterations only; pass
# these with --shapes, e.g. --shapes llama3_8b_t4096 llama3_70b_t4096).
QUICK_SHAPES: list[tuple[int, ...]] = [PRESETS["llama3_8b_t4096"], PRESETS["llama3_70b_t4096"]]
BASELINE = "torch"
WHOLE = (
    "torch",
    "ours",
    "ours_regather",
    "torch_compiled",
    "ours_compiled",
    "torch_compiled_routed",
)
__all__ = ["DEFAULT_SHAPES", "DTYPE", "OP", "PRESETS", "QUICK_SHAPES", "format_table",
           "parse_shape", "run"]  # fmt: skip


def parse_shape(text: str) -> tuple[int, ...]:
    """A preset name or ``TxHxF`` (total tokens x hidden x FFN width) -> (T, H, F)."""
    if text in PRESETS:
        return PRESETS[text]
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f"tp_mlp shape {text!r} is neither a preset ({', '.join(PRESETS)}) nor TxHxF "
            "(total tokens x hidden x FFN width, each >= 1)"
        )
    t, h, f = (int(p) for p in parts)
    return t, h, f


def dtype_for(device: torch.device) -> torch.dtype:
    """bf16 on GPUs; float32 on CPU ranks, where the run checks the harness and the variants'
    agreement (an fp32 tolerance means something there, bf16's would hide a wrong shard)."""
    return DTYPE if device.type == "cuda" else torch.float32


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class _Inputs:
    x_local: torch.Tensor  # [T/world, H] this rank's tokens, a leaf that requires grad
    x_full: torch.Tensor  # [T, H] all ranks' tokens (gathered once), a leaf for `cublas`
    dy_full: torch.Tensor  # [T, H] an output gradient for `cublas`'s backward
    gathered: torch.Tensor  # [T, H] the collectives' buffer
    partial: torch.Tensor  # [T, H] what nccl_collectives reduce-scatters
    scattered: torch.Tensor  # [T/world, H] and where it lands


def _make_inputs(t: int, h: int, ctx: RunContext, dtype: torch.dtype, seed: int) -> _Inputs:
    gen = generator(ctx, seed)
    x_local = torch.randn(t // ctx.world, h, generator=gen, device=ctx.device, dtype=dtype)
    x_full = torch.empty(t, h, device=ctx.device, dtype=dtype)
    _all_gather(x_full, x_local, ctx)
    return _Inputs(
        x_local.requires_grad_(),
        x_full.requires_grad_(),
        torch.randn(t, h, generator=gen, device=ctx.device, dtype=dtype),
        torch.empty(t, h, device=ctx.device, dtype=dtype),
        torch.randn(t, h, generator=gen, device=ctx.device, dtype=dtype),
        torch.empty(t // ctx.world, h, device=ctx.device, dtype=dtype),
    )


def _full_weights(
    h: int, f: int, ctx: RunContext, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded weights, the same on every rank: up [F, H], down [H, F] (nn.Linear
    layout), N(0, 1/fan_in) so that activations stay O(1)."""
    gen = torch.Generator(device=ctx.device).manual_seed(20260)
    up = torch.randn(f, h, generator=gen, device=ctx.device, dtype=dtype) / math.sqrt(h)
    down = torch.randn(h, f, generator=gen, device=ctx.device, dtype=dtype) / math.sqrt(f)
    return up, down


def _all_gather(out: torch.Tensor, x_local: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    if ctx.world == 1:
        return out.copy_(x_local)
    from overlap_kernels.runtime.collectives import all_gather_single

    all_gather_single(out, x_local, group=ctx.group)
    return out


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    if ctx.world == 1:
        return out.copy_(x)
    from overlap_kernels.runtime.collectives import reduce_scatter_single

    reduce_scatter_single(out, x, group=ctx.group)
    return out


def _waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its collective finished: torch's eager styles return the input gradient's
    reduce-scatter still in flight (an AsyncCollectiveTensor), and a step that did not wait
    for it would be timed short by that collective."""
    wait = getattr(t, "wait", None)  # AsyncCollectiveTensor.wait(); plain tensors have none
    return wait() if callable(wait) else t


# ----------------------------------------------------------------------------- the block


def _mesh(ctx: RunContext) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(ctx.group or dist.group.WORLD, ctx.device.type)


def _block(up: torch.Tensor, down: torch.Tensor) -> torch.nn.Sequential:
    """The block with the full weights (parallelize_module shards them)."""
    f, h = up.shape
    block = torch.nn.Sequential(
        torch.nn.Linear(h, f, bias=False, device="meta"),
        torch.nn.SiLU(),
        torch.nn.Linear(f, h, bias=False, device="meta"),
    )
    block[0].weight = torch.nn.Parameter(up)
    block[2].weight = torch.nn.Parameter(down)
    return block


def _parallel(
    styles: str, up: torch.Tensor, down: torch.Tensor, mesh: Any, keep_gathered: bool = True
) -> torch.nn.Module:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    if styles == "torch":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        colwise = ColwiseParallel(input_layouts=Shard(0))
    else:
        from overlap_kernels.integrations.dtensor import (
            OverlapColwiseParallel,
        )
        from overlap_kernels.integrations.dtensor import (
            OverlapRowwiseParallel as RowwiseParallel,
        )

        colwise = OverlapColwiseParallel(input_layouts=Shard(0), keep_gathered=keep_gathered)
    return parallelize_module(_block(up, down), mesh, {
        "0": colwise,
        "2": RowwiseParallel(output_layouts=Shard(0)),
    })  # fmt: skip


def _compiled(block: torch.nn.Module, routed: bool) -> tuple[Callable[..., Any], Any]:
    """``torch.compile`` of ``block`` (static shapes, one graph), and with ``routed`` the
    pass that sends its collectives into our ops (its ``routed`` counts), set for this
    compilation only: ``enable`` fills a namespace, not Inductor's global config."""
    options = None
    route = None
    if routed:
        from overlap_kernels.integrations import inductor

        scoped = SimpleNamespace(post_grad_custom_post_pass=None)
        route = inductor.enable(scoped)
        options = {"post_grad_custom_post_pass": scoped.post_grad_custom_post_pass}
    return torch.compile(block, fullgraph=True, dynamic=False, options=options), route


@dataclasses.dataclass
class _Step:
    """One training step of a parallel block (or of compiled ``fn`` of it)."""

    block: torch.nn.Module
    fn: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for p in self.block.parameters():
            p.grad = None
        x.grad = None
        y = self.fn(x)
        loss = 0.5 * y.float().square().sum()
        loss.backward()
        x.grad = _waited(x.grad)
        return loss, y

    def results(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(loss, y, dx, dW_up shard, dW_down shard) of one step, for the check."""
        loss, y = self(x)
        up, down = self.block[0].weight.grad, self.block[2].weight.grad
        return loss.detach(), _waited(y).detach(), x.grad, up.to_local(), down.to_local()


def _local_step(s: _Inputs, up: torch.Tensor, down: torch.Tensor) -> None:
    """`cublas`: the rank's share of the compute, no communication: up [F/world, H] and down
    [H, F/world] (leaves), on all T tokens, backward from a given output gradient."""
    up.grad = down.grad = s.x_full.grad = None
    y = torch.nn.functional.linear(torch.nn.functional.silu(
        torch.nn.functional.linear(s.x_full, up)), down)  # fmt: skip
    y.backward(s.dy_full)


def _collectives(s: _Inputs, ctx: RunContext) -> None:
    """`nccl_collectives`: forward's gather of x and reduce-scatter of y, backward's gather
    of dy and reduce-scatter of dx, one after the other."""
    for _ in range(2):
        _all_gather(s.gathered, s.x_local.detach(), ctx)
        _reduce_scatter(s.scattered, s.partial, ctx)


def _reference(
    s: _Inputs, up: torch.Tensor, down: torch.Tensor, ctx: RunContext
) -> tuple[torch.Tensor, ...]:
    """The check's oracle, from all ranks' tokens and the full weights, in fp32 (fp64 on
    CPU): the whole block's loss (the sum of the ranks' losses, whose gradient the parallel
    backward computes), then this rank's loss, rows and weight shards."""
    wide = torch.float64 if ctx.device.type == "cpu" else torch.float32
    x, w_up, w_down = (t.detach().to(wide).requires_grad_() for t in (s.x_full, up, down))
    y = torch.nn.functional.linear(torch.nn.functional.silu(
        torch.nn.functional.linear(x, w_up)), w_down)  # fmt: skip
    (0.5 * y.square().sum()).backward()
    t, f = x.shape[0] // ctx.world, w_up.shape[0] // ctx.world
    rows, cols = slice(ctx.rank * t, (ctx.rank + 1) * t), slice(ctx.rank * f, (ctx.rank + 1) * f)
    mine = y.detach()[rows]
    return (0.5 * mine.square().sum(), mine, x.grad[rows], w_up.grad[cols], w_down.grad[:, cols])


def _worst(out: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> float:
    """The largest relative Frobenius error of the five results (inf for a wrong shape)."""
    return max(rel_frobenius(o, r) for o, r in zip(out, ref, strict=True))


# ----------------------------------------------------------------------------- variants


def _routed_note(route: Any) -> str:
    """What the pass did: per graph it ran on (forward, backward), the collectives it routed,
    e.g. ``routed ag/rs/ar: 1/1/0, 1/1/0`` (all-gathers, reduce-scatters, all-reduces)."""
    if route is None or not route.routed:
        return "no graph compiled here (served from the compile caches): routing not observed"
    first = route.routed[0]
    fields = first._fields
    kinds = "/".join("".join(w[0] for w in name.split("_")) for name in fields)
    counts = ", ".join("/".join(map(str, c)) for c in route.routed)
    return f"routed {kinds} per graph: {counts}"


def _variants(
    ctx: RunContext,
    sets: list[_Inputs],
    up: torch.Tensor,
    down: torch.Tensor,
    ref: tuple[torch.Tensor, ...],
    dtype: torch.dtype,
) -> tuple[list[Variant], dict[str, Check], dict[str, Any]]:
    """The variants, each one's check against ``ref`` on input set 0, and the routing pass
    (whose counts are known only after the check has compiled the graphs)."""
    f = up.shape[0] // ctx.world
    cols = slice(ctx.rank * f, (ctx.rank + 1) * f)
    up_local = up[cols].detach().clone().requires_grad_()
    down_local = down[:, cols].detach().clone().requires_grad_()
    base = {"dtype": str(dtype).removeprefix("torch."), "activation": "silu"}
    variants = [
        Variant("cublas", cycled(sets, lambda s: _local_step(s, up_local, down_local)),
                config=base, whole_op=False),
        Variant("nccl_collectives", cycled(sets, lambda s: _collectives(s, ctx)), whole_op=False),
    ]  # fmt: skip
    checks: dict[str, Check] = {}
    routes: dict[str, Any] = {}
    mesh = _mesh(ctx)
    torch._dynamo.reset()  # the shape's compiled variants start afresh (no dynamic recompiles)
    for name in WHOLE:
        styles = name.split("_")[0]
        compiled = name.endswith(("_compiled", "_compiled_routed"))
        keep = not name.endswith("_regather")
        config = {**base, "styles": styles, "compiled": compiled,
                  "routed": name.endswith("_routed"), "keep_gathered": keep}  # fmt: skip
        try:  # a block of its own: no compiled variant finds another's graph in dynamo's cache
            block = _parallel(styles, up, down, mesh, keep)
            fn, route = _compiled(block, name.endswith("_routed")) if compiled else (block, None)
        except Exception as e:  # noqa: BLE001 - recorded; the other variants still run
            variants.append(unavailable(name, "error", f"{type(e).__name__}: {e}"[:2000]))
            continue
        step = _Step(block, fn)
        variants.append(
            Variant(name, cycled(sets, lambda s, st=step: st(s.x_local)), config=config)
        )
        checks[name] = Check(lambda st=step: st.results(sets[0].x_local), ref,
                             against="fp64 reference" if ctx.device.type == "cpu"
                             else "fp32 reference", compare=_worst)  # fmt: skip
        if route is not None:
            routes[name] = route
    return variants, checks, routes


def bench_shape(
    shape: tuple[int, ...], ctx: RunContext, settings: Settings, progress: Progress
) -> list[dict[str, Any]]:
    """Rows for one shape: every variant, then the bound."""
    t, h, f = shape
    dims = dict(zip(SHAPE_KEYS, shape))
    if t % ctx.world or f % ctx.world:
        raise ValueError(f"tp_mlp {shape_str(dims)}: T and F must divide by {ctx.world} ranks")
    dtype = dtype_for(ctx.device)
    up, down = _full_weights(h, f, ctx, dtype)
    # Activations and weights a step touches: with them the default shapes are far over L2.
    bytes_per_set = (4 * t * h + 2 * t * f // ctx.world + 2 * h * f // ctx.world) * dtype.itemsize
    sets = input_sets(lambda seed: _make_inputs(t, h, ctx, dtype, seed), bytes_per_set, ctx)
    ref = _reference(sets[0], up, down, ctx)
    variants, checks, routes = _variants(ctx, sets, up, down, ref, dtype)
    del up, down  # the blocks hold their shards
    check_variants(ctx, variants, checks, settings)
    del ref, checks
    for v in variants:
        if v.name in routes:
            v.note = _routed_note(routes[v.name]) + (f"; {v.note}" if v.note else "")
    progress.step(f"{OP} {shape_str(dims)}: checked")
    # nccl-tests' bus bandwidth: each all-gather and reduce-scatter moves (world-1)/world of
    # the [T, H] tensor per rank.
    busbw_bytes = 4 * (ctx.world - 1) / ctx.world * t * h * dtype.itemsize
    rows = measure(
        OP,
        dims,
        variants,
        ctx,
        settings,
        progress,
        flops=12.0 * t * h * f / ctx.world,  # 6 GEMMs of 2 T H (F/world) FLOPs per rank
        parts=("cublas", "nccl_collectives"),
        busbw_bytes=busbw_bytes,
    )
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(ctx: RunContext, shapes: list[tuple[int, ...]], settings: Settings) -> list[dict[str, Any]]:
    """All shapes; progress on rank 0."""
    return run_shapes(
        OP, shapes, ctx, settings, {}, lambda shape, progress: bench_shape(shape, ctx, settings, progress)
    )  # fmt: skip


# ----------------------------------------------------------------------------- table


def _cell(r: dict[str, Any] | None, key: str, spec: str) -> str:
    if r is None or r["status"] == "skipped":
        return "-"
    if r["status"] == "error":
        return "ERR"
    value = r[key]
    text = "-" if value is None else format(value, spec)
    return text + ("!" if r["status"] == "check_failed" else "")


def format_table(rows: list[dict[str, Any]], world: int | None = None) -> str:
    """One line per shape and variant: ms, TFLOP/s per rank, the speedup over ``torch`` and
    % of the bound; then each variant's geometric-mean speedup over ``torch`` (no goal
    lines, on any number of ranks: ``world`` is the entries' common argument)."""
    by_shape: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault(shape_str(r["shape"]), {})[r["variant"]] = r
    head = ["TxHxF", "variant", "ms", "TFLOP/s", f"x{BASELINE}", "%bound", "note"]
    lines, ratios = [], {v: [] for v in WHOLE if v != BASELINE}
    for shape, vs in by_shape.items():
        base = vs.get(BASELINE)
        base_ms = base["ms"] if base is not None and base["status"] == "ok" else None
        for i, (name, r) in enumerate(vs.items()):
            ok = r["status"] == "ok"
            ratio = speedup(base_ms, r["ms"]) if ok and name in WHOLE else None
            if name in ratios:
                ratios[name].append(ratio)
            noted = not ok or name in ("nccl_collectives", "torch_compiled_routed")
            note = r["note"] if noted else ""
            lines.append([shape if i == 0 else "", name, _cell(r, "ms", ".3f"),
                          _cell(r, "tflops", ".1f"), "-" if ratio is None else f"{ratio:.2f}",
                          _cell(r, "pct_of_bound", ".0f"), " ".join(note.split())[:60]])  # fmt: skip
    out = grid(head, lines)
    for name, xs in ratios.items():
        g = geomean(xs)
        n = sum(x is not None for x in xs)
        shown = "-" if g is None else f"{g:.3f}"
        out.append(f"geomean speedup of {name} over {BASELINE}: {shown} ({n} of {len(xs)} shapes)")
    out.append(
        "ms per training step (forward, loss, backward; no optimizer): median over steps, max "
        "over ranks. TFLOP/s per rank: 12 T H F / world per step. %bound: max(cublas, "
        "nccl_collectives) / ms. '!' failed its check, ERR raised, '-' not available."
    )
    return "\n".join(out)
