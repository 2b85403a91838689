"""The moe entry's decode variants: our graph mode replayed in CUDA graphs beside the NCCL path.

    nccl_dc           nccl_dispatch then nccl_combine of its recv_x (the round trip), eager:
                      nccl_dispatch reads the counts on the host (.tolist()) to size its
                      buffers and splits, which no CUDA graph can hold, so it is not captured
    ours_graph_dc     moe_dispatch_graph then moe_combine_graph of its recv_x, captured in one
                      CUDA graph per input set and replayed (on CPU ranks, Triton's interpreter
                      has no graphs: called eagerly)
    ours_graph_layer  ok.moe_mlp with max_tokens_per_rank = T: the graph mode's layer
                      (moe_dispatch_graph -> gate/up torch._grouped_mm by the handle's device
                      expert_ends -> silu(gate) * up -> down -> moe_combine_graph), captured likewise
    ours_graph_eager_layer  the same call eagerly: the graph mode as an eager decode path (no
                      host read of the counts), beside the eager layers

The graph mode is for decode sizes (its receive blocks live in the 32 MiB replay buffer):
at T > bench.moe.DECODE_MAX_T the ours_graph variants are skipped, saying so. Checks:
ours_graph_dc and nccl_dc against the NCCL round trip (bench.moe's combine check),
ours_graph_layer and ours_graph_eager_layer against nccl_layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.common import Check, cycled, graphed, unavailable
from bench.harness import RunContext, Variant

GRAPH_VARIANTS = ("nccl_dc", "ours_graph_dc", "ours_graph_layer", "ours_graph_eager_layer")


def replayed(
    ctx: RunContext, sets: list[Any], body: Callable[[Any], torch.Tensor]
) -> tuple[Callable[[], Any], Callable[[], torch.Tensor], str]:
    """(the timed call, the checked call, a note): ``body`` captured per input set and
    replayed on CUDA; called eagerly on CPU ranks."""
    if ctx.device.type != "cuda":
        return cycled(sets, body), lambda: body(sets[0]), "eager: CPU ranks have no CUDA graphs"
    replay, first = graphed(sets, body)

    def checked() -> torch.Tensor:
        replay(0)
        return first

    return replay, checked, "replayed in CUDA graphs"


def graph_variants(
    ctx: RunContext,
    shape: tuple[int, ...],
    sets: list[Any],
    experts: Any,
    refs: dict[str, Any],
    ours: dict[str, Any],
    missing: dict[str, str],
) -> tuple[list[Variant], dict[str, Check]]:
    """The decode variants of one shape and their checks (module docstring)."""
    from bench import moe

    t, _, e, k, _ = shape
    group = ctx.group if ctx.group is not None else dist.group.WORLD

    def round_trip(s: Any) -> torch.Tensor:
        d = moe.nccl_dispatch(s.x, s.topk_ids, s.topk_weights, num_experts=e)
        return moe.nccl_combine(d.recv_x, d)

    sums = moe.combine_sums(sets[0], ctx)
    not_captured = ("eager: nccl_dispatch reads the counts on the host (.tolist()) to size its "
                    "buffers, which a CUDA graph cannot hold")  # fmt: skip
    variants = [Variant("nccl_dc", cycled(sets, round_trip), whole_op=False, note=not_captured)]
    checks = {"nccl_dc": Check(lambda: round_trip(sets[0]), refs["nccl_combine"], "nccl_combine", **sums)}  # fmt: skip
    lacking = "; ".join(sorted({missing[n] for n in ("moe_dispatch_graph", "moe_combine_graph") if n in missing}))  # fmt: skip
    why = lacking or (
        f"T = {t} > {moe.DECODE_MAX_T}: the graph mode is for decode sizes" if t > moe.DECODE_MAX_T else ""
    )  # fmt: skip
    if why:
        variants += [unavailable("ours_graph_dc", "skipped", why, whole_op=False),
                     unavailable("ours_graph_layer", "skipped", why),
                     unavailable("ours_graph_eager_layer", "skipped", why)]  # fmt: skip
        return variants, checks
    dispatch, combine = ours["moe_dispatch_graph"], ours["moe_combine_graph"]
    layer_missing = missing.get("moe_mlp", "")
    kw = {"num_experts": e, "max_tokens_per_rank": t, "max_topk": k}

    def dc(s: Any) -> torch.Tensor:
        recv_x, handle = dispatch(s.x, s.topk_ids, s.topk_weights, group, **kw)
        return combine(recv_x, handle)

    def layer(s: Any) -> torch.Tensor:
        return ours["moe_mlp"](s.x, s.topk_ids, s.topk_weights, experts.w_gate_up,
                               experts.w_down, group, num_experts=e, max_tokens_per_rank=t)  # fmt: skip

    for name, body, ref, against, extra in (
        ("ours_graph_dc", dc, refs["nccl_combine"], "nccl_combine", sums),
        ("ours_graph_layer", layer, refs["nccl_layer"], "nccl_layer", {}),
    ):
        if name == "ours_graph_layer" and layer_missing:
            variants.append(unavailable(name, "skipped", layer_missing))
            continue
        try:
            timed, checked, note = replayed(ctx, sets, body)
        except Exception as err:  # noqa: BLE001 - recorded; the other variants still run
            variants.append(unavailable(name, "error", f"capture raised {type(err).__name__}: {err}"[:2000], name == "ours_graph_layer"))  # fmt: skip
            continue
        variants.append(Variant(name, timed, whole_op=name == "ours_graph_layer", note=note,
                                config={"max_tokens_per_rank": t, "max_topk": k}))  # fmt: skip
        checks[name] = Check(checked, ref, against, **extra)
    if layer_missing:
        variants.append(unavailable("ours_graph_eager_layer", "skipped", layer_missing))
    else:
        variants.append(Variant("ours_graph_eager_layer", cycled(sets, layer), note="eager",
                                config={"max_tokens_per_rank": t, "max_topk": k}))  # fmt: skip
        checks["ours_graph_eager_layer"] = Check(
            lambda: layer(sets[0]), refs["nccl_layer"], "nccl_layer"
        )
    return variants, checks
