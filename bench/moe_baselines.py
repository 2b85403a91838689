"""The moe entry's baselines beside the NCCL path: what MoE users run at scale.

    symm_mem_layer  torchtitan's token path on torch's symmetric memory:
                    torch.ops.symm_mem.all_to_all_vdev_2d (one row per (token, expert) pair,
                    rank-major in, expert-major out, each expert's rows padded to 8 as
                    torchtitan pads them for bf16 torch._grouped_mm), the expert MLP by
                    torch._grouped_mm with the received counts as device offsets,
                    all_to_all_vdev_2d_offset back, then each token's weighted sum (fp32,
                    rounded once). No host sync, so at decode sizes (T <= DECODE_MAX_T)
                    symm_mem_graph_layer times it captured in CUDA graphs, as
                    ours_graph_layer is. It needs CUDA and NVSHMEM-backed symmetric
                    memory for the whole process, chosen before any allocation: run
                    ``python -m bench --op moe --symm-mem-backend NVSHMEM`` (our ops then
                    allocate their workspace through it too). torch takes at most 16 experts
                    per rank (its kernels' tile count): shapes past it are skipped, saying so.
    deepep_layer    DeepEP's intranode (NVLink) dispatch and combine (its V1 ``Buffer`` API:
                    get_dispatch_layout, dispatch, combine) around the same expert MLP; skipped
                    where ``deep_ep`` is not importable. DeepEP is not on PyPI: build it on the
                    GPU host from its source release with the host's nvcc and NVSHMEM (the
                    nvidia-nvshmem-cu13 wheel's libraries), e.g.
                    ``NVSHMEM_DIR=$(python -c 'import nvidia.nvshmem, os; print(os.path.dirname(nvidia.nvshmem.__file__))') TORCH_CUDA_ARCH_LIST=9.0 pip wheel --no-deps --no-build-isolation -w /tmp/wheels .``
                    in a checkout of a V1 release (V2's ElasticBuffer needs NCCL >= 2.30.4),
                    then ``pip install --no-deps /tmp/wheels/deep_ep-*.whl`` on the host; keep
                    the wheel out of git (scripts/deepep_source.sh and deepep_host.sh do
                    this). Its dispatch reads the received counts on the host (as the NCCL
                    path does).
    deepep_graph_layer  at decode sizes, the same with no host sync (dispatch sized for the
                    worst case by DeepEP's ``num_worst_tokens``, the expert counts made on
                    the device), captured in CUDA graphs. DeepEP's low-latency kernels are not
                    timed: they need NVSHMEM's IBGDA transport, which needs a Mellanox NIC,
                    and the GPU hosts here have none.

Each is checked against nccl_layer (the layer's norm check) and timed with the others.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.common import Check, cycled, unavailable
from bench.harness import RunContext, Variant
from bench.moe_graphs import replayed

BASELINES = ("symm_mem_layer", "symm_mem_graph_layer", "deepep_layer", "deepep_graph_layer")
ALIGN = 8  # rows per expert, as torchtitan pads them for bf16 torch._grouped_mm
SYMM_MEM_MAX_LOCAL_EXPERTS = 16  # torch's check in all_to_all_vdev_2d (NUM_TILES)


def reads_counts_on_host(impl: str) -> str:
    """Why a layer around the grouped GEMM ``impl`` cannot be captured ("" where it can)."""
    if impl == "torch._grouped_mm":
        return ""
    return f"the grouped GEMM here is {impl}, which reads the counts on the host"


def symm_mem_why_not(ctx: RunContext, impl: str, experts: int) -> str:
    """Why the all_to_all_vdev_2d baseline cannot run here ("" where it can)."""
    if ctx.device.type != "cuda":
        return "CPU ranks: torch.ops.symm_mem.all_to_all_vdev_2d runs on CUDA with NVSHMEM"
    if experts // ctx.world > SYMM_MEM_MAX_LOCAL_EXPERTS:
        return (f"torch's all_to_all_vdev_2d takes at most {SYMM_MEM_MAX_LOCAL_EXPERTS} experts per "
                f"rank (its kernels' tile count); this shape has {experts // ctx.world}")  # fmt: skip
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as e:  # noqa: BLE001
        return f"torch.distributed._symmetric_memory not importable: {e}"
    if getattr(getattr(torch.ops, "symm_mem", None), "all_to_all_vdev_2d", None) is None:
        return f"torch {torch.__version__} has no torch.ops.symm_mem.all_to_all_vdev_2d"
    if not symm_mem.is_nvshmem_available():
        return f"NVSHMEM is not available to torch {torch.__version__} here"
    backend = symm_mem.get_backend(ctx.device)
    if backend != "NVSHMEM":
        return (f"torch's symmetric memory is on backend {backend} in this process; "
                "all_to_all_vdev_2d needs NVSHMEM buffers: run with --symm-mem-backend NVSHMEM")  # fmt: skip
    return reads_counts_on_host(impl)


class SymmMemPath:
    """The buffers of one shape (symmetric, NVSHMEM), sized for the routing of every set."""

    def __init__(self, ctx: RunContext, shape: tuple[int, ...], most_received: int):
        import torch.distributed._symmetric_memory as symm_mem

        t, h, e, k, _ = shape
        self.e, self.k, self.ne = e, k, e // ctx.world
        self.group_name = (ctx.group or dist.group.WORLD).group_name
        rows_out = most_received + self.ne * ALIGN  # the routing's, each expert padded
        kw = {"device": ctx.device, "dtype": torch.bfloat16}
        self.send = symm_mem.empty(t * k, h, **kw)
        self.recv = symm_mem.empty(rows_out, h, **kw)
        self.y = symm_mem.empty(rows_out, h, **kw)
        self.back = symm_mem.empty(t * k, h, **kw)
        self.in_splits = symm_mem.empty(e, dtype=torch.int64, device=ctx.device)
        self.recv_so = symm_mem.empty((2, e), dtype=torch.int64, device=ctx.device)
        self.back_so = symm_mem.empty((2, e), dtype=torch.int64, device=ctx.device)
        for buffer in (self.send, self.recv, self.y, self.back, self.in_splits, self.recv_so, self.back_so):  # fmt: skip
            symm_mem.rendezvous(buffer, self.group_name)

    def layer(self, s: Any, experts: Any) -> torch.Tensor:
        from bench import moe

        ops = torch.ops.symm_mem
        t = s.x.shape[0]
        ids = s.topk_ids.reshape(-1)  # every slot is used in the bench's routing
        order = torch.argsort(ids, stable=True)  # by global expert: rank-major, as the op takes
        self.send.copy_(s.x[order // self.k])
        # Counted by scatter: bincount reads its largest id on the host, which no graph holds.
        self.in_splits.zero_().index_add_(0, ids, torch.ones_like(ids))
        ops.all_to_all_vdev_2d(self.send, self.recv, self.in_splits, self.recv_so, self.group_name, major_align=ALIGN)  # fmt: skip
        # Each local expert's rows (all sources), padded up to ALIGN (an empty one to ALIGN).
        per_expert = self.recv_so[0].view(self.ne, -1).sum(1)
        padded = ((per_expert + ALIGN - 1) // ALIGN * ALIGN).clamp_min(ALIGN)
        ends = padded.cumsum(0).to(torch.int32)
        self.y.copy_(moe.expert_mlp(self.recv, [], ends, experts, "torch._grouped_mm"))
        ops.all_to_all_vdev_2d_offset(self.y, self.back, self.recv_so, self.back_so, self.group_name)  # fmt: skip
        weights = s.topk_weights.reshape(-1)[order].float()[:, None]
        out = torch.zeros(t, self.back.shape[1], device=s.x.device, dtype=torch.float32)
        return out.index_add_(0, order // self.k, self.back.float() * weights).to(s.x.dtype)


def deepep_why_not(ctx: RunContext) -> str:
    if ctx.device.type != "cuda":
        return "CPU ranks: DeepEP runs on CUDA"
    if importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not installed (bench/moe_baselines.py: how to build it on the GPU host)"
    return ""


class DeepEpPath:
    """DeepEP V1's intranode dispatch and combine around the expert MLP."""

    def __init__(self, ctx: RunContext, shape: tuple[int, ...]):
        import deep_ep

        t, h, e, _, _ = shape
        group = ctx.group or dist.group.WORLD
        size = group.size()
        hidden_bytes = h * 2
        nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, size)
                  for config in (deep_ep.Buffer.get_dispatch_config(size), deep_ep.Buffer.get_combine_config(size)))  # fmt: skip
        self.buffer, self.e, self.ne = deep_ep.Buffer(group, nvl, 0), e, e // size
        self.worst = t * size  # the most tokens a rank can receive: every token of every rank

    def _dispatch(self, s: Any, worst: int = 0) -> tuple:
        b = self.buffer
        per_rank, per_rdma, per_expert, in_rank, _ = b.get_dispatch_layout(s.topk_ids, self.e)
        return b.dispatch(
            s.x, topk_idx=s.topk_ids, topk_weights=s.topk_weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            num_worst_tokens=worst,
        )  # fmt: skip

    def layer(self, s: Any, experts: Any, impl: str) -> torch.Tensor:
        """Dispatch reads the received counts on the host, as the NCCL path does."""
        from bench import moe

        recv_x, recv_ids, recv_w, counts, handle, _ = self._dispatch(s)
        # One row per received token; its pairs here are the slots with a local expert id.
        k = recv_ids.shape[1]
        flat = recv_ids.reshape(-1)
        order = torch.argsort(torch.where(flat >= 0, flat, len(counts)), stable=True)[: sum(counts)]
        ends = moe.group_ends_of(list(counts), s.x.device)
        y = moe.expert_mlp(recv_x[order // k], list(counts), ends, experts, impl)
        weighted = y.float() * recv_w.reshape(-1)[order].float()[:, None]
        return self._combine(recv_x.shape[0], order // k, weighted, y.dtype, handle)

    def graph_layer(self, s: Any, experts: Any) -> torch.Tensor:
        """The same layer with no host sync, so that a CUDA graph holds it: dispatch sized
        for the worst case (DeepEP's ``num_worst_tokens``; unused rows carry expert -1),
        the counts per expert made on the device for torch._grouped_mm."""
        from bench import moe

        recv_x, recv_ids, recv_w, _, handle, _ = self._dispatch(s, self.worst)
        k = recv_ids.shape[1]
        flat = recv_ids.reshape(-1)
        valid = flat >= 0
        expert = torch.where(valid, flat, self.ne)  # slots of no local expert sort last
        order = torch.argsort(expert, stable=True)
        counts = torch.zeros(self.ne + 1, dtype=torch.int64, device=flat.device)
        counts.index_add_(0, expert, torch.ones_like(expert))
        ends = counts[: self.ne].cumsum(0).to(torch.int32)
        y = moe.expert_mlp(recv_x[order // k], [], ends, experts, "torch._grouped_mm")
        # Rows past the last expert's end are not computed: their weight is a where, not a
        # product, so that whatever they hold never reaches a token.
        weighted = y.float() * recv_w.reshape(-1)[order].float()[:, None]
        weighted = torch.where(valid[order][:, None], weighted, 0.0)
        return self._combine(recv_x.shape[0], order // k, weighted, y.dtype, handle)

    def _combine(self, received: int, row_of_pair: torch.Tensor, weighted: torch.Tensor,
                 dtype: torch.dtype, handle: Any) -> torch.Tensor:  # fmt: skip
        """Each received token's pairs summed in fp32 (rounded once), then DeepEP's combine."""
        rows = torch.zeros(received, weighted.shape[1], device=weighted.device, dtype=torch.float32)
        out, _, _ = self.buffer.combine(rows.index_add_(0, row_of_pair, weighted).to(dtype), handle)
        return out


def _set_up(why: str, make: Callable[[], Any]) -> tuple[Any, str]:
    """(a baseline's path made by ``make``, or None; why it cannot run: ``why``, or the
    set-up's error)."""
    if why:
        return None, why
    try:
        return make(), ""
    except Exception as err:  # noqa: BLE001 - recorded; the other variants still run
        return None, f"set-up raised {type(err).__name__}: {err}"[:2000]


def _not_run(name: str, why: str) -> Variant:
    return unavailable(name, "error" if why.startswith(("set-up", "capture")) else "skipped", why)


def _captured(
    ctx: RunContext, name: str, sets: list[Any], layer: Callable, config: dict, refs: dict
) -> tuple[Variant, dict[str, Check]]:
    """Variant ``name``: a baseline's ``layer`` captured per input set and replayed."""
    try:
        timed, checked, note = replayed(ctx, sets, layer)
    except Exception as err:  # noqa: BLE001 - recorded; the other variants still run
        return _not_run(name, f"capture raised {type(err).__name__}: {err}"[:2000]), {}
    return Variant(name, timed, config=config, note=note), {
        name: Check(checked, refs["nccl_layer"], "nccl_layer")
    }


def baseline_variants(
    ctx: RunContext,
    shape: tuple[int, ...],
    sets: list[Any],
    experts: Any,
    refs: dict[str, Any],
    impl: str,
    graph_impl: str,
    most_received: int,
) -> tuple[list[Variant], dict[str, Check]]:
    """Each baseline's layer, and at decode sizes the same captured in CUDA graphs, for
    one shape; each skipped with the reason where it cannot run here. Checked against
    nccl_layer. ``impl``: the eager layers' expert GEMM; ``graph_impl``: the one a
    captured layer would run (torch._grouped_mm, or none can be captured).
    ``most_received``: the most pairs any rank receives in any set."""
    from bench import moe

    symm, symm_why = _set_up(symm_mem_why_not(ctx, graph_impl, shape[2]),
                             lambda: SymmMemPath(ctx, shape, most_received))  # fmt: skip
    deepep, deepep_why = _set_up(deepep_why_not(ctx), lambda: DeepEpPath(ctx, shape))
    graph_why = reads_counts_on_host(graph_impl)
    if shape[0] > moe.DECODE_MAX_T:
        graph_why = f"T = {shape[0]} > {moe.DECODE_MAX_T}: timed captured at decode sizes only"
    symm_config = {"symm_mem_backend": "NVSHMEM", "major_align": ALIGN}
    symm_layer = symm and (lambda s: symm.layer(s, experts))  # (no host sync: captured as it is)
    baselines = (  # (name, why not, layer, config)
        ("symm_mem_layer", symm_why, symm_layer, symm_config),
        ("symm_mem_graph_layer", symm_why or graph_why, symm_layer, symm_config),
        ("deepep_layer", deepep_why, deepep and (lambda s: deepep.layer(s, experts, impl)),
         {"grouped_mm": impl}),
        ("deepep_graph_layer", deepep_why or graph_why, deepep and (lambda s: deepep.graph_layer(s, experts)),
         deepep and {"num_worst_tokens": deepep.worst}),
    )  # fmt: skip
    variants: list[Variant] = []
    checks: dict[str, Check] = {}
    for name, why, layer, config in baselines:
        if why:
            variants.append(_not_run(name, why))
        elif name.endswith("_graph_layer"):
            variant, check = _captured(ctx, name, sets, layer, config, refs)
            variants.append(variant)
            checks.update(check)
        else:
            variants.append(Variant(name, cycled(sets, layer), config=config))
            checks[name] = Check(lambda layer=layer: layer(sets[0]), refs["nccl_layer"], "nccl_layer")  # fmt: skip
    return variants, checks


__all__ = ["BASELINES", "baseline_variants"]
