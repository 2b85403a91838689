"""The moe entry's baselines beside the NCCL path: what MoE users run at scale.

    symm_mem_layer  torchtitan's token path on torch's symmetric memory:
                    torch.ops.symm_mem.all_to_all_vdev_2d (one row per (token, expert) pair,
                    rank-major in, expert-major out, each expert's rows padded to 8 as
                    torchtitan pads them for bf16 torch._grouped_mm), the expert MLP by
                    torch._grouped_mm with the received counts as device offsets,
                    all_to_all_vdev_2d_offset back, then each token's weighted sum (fp32,
                    rounded once). No host sync. It needs CUDA and NVSHMEM-backed symmetric
                    memory for the whole process, chosen before any allocation: run
                    ``python -m bench --op moe --symm-mem-backend NVSHMEM`` (our ops then
                    allocate their workspace through it too). torch checks that the experts
                    per rank are at most its kernels' tile count (32 or fewer): shapes past it
                    record torch's error.
    deepep_layer    DeepEP's intranode (NVLink) dispatch and combine (its V1 ``Buffer`` API:
                    get_dispatch_layout, dispatch, combine) around the same expert MLP; skipped
                    where ``deep_ep`` is not importable. DeepEP is not on PyPI: build it on the
                    GPU host from its source release with the host's nvcc and NVSHMEM (the
                    nvidia-nvshmem-cu13 wheel's libraries), e.g.
                    ``NVSHMEM_DIR=$(python -c 'import nvidia.nvshmem, os; print(os.path.dirname(nvidia.nvshmem.__file__))') TORCH_CUDA_ARCH_LIST=9.0 pip wheel --no-deps --no-build-isolation -w /tmp/wheels .``
                    in a checkout of a V1 release (V2's ElasticBuffer needs NCCL >= 2.30.4),
                    then ``pip install --no-deps /tmp/wheels/deep_ep-*.whl`` on the host; keep
                    the wheel out of git. Its dispatch reads the received counts on the host
                    (as the NCCL path does).

Both are checked against nccl_layer (the layer's norm check) and timed with the others.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist

from bench.common import Check, cycled, unavailable
from bench.harness import RunContext, Variant

BASELINES = ("symm_mem_layer", "deepep_layer")
ALIGN = 8  # rows per expert, as torchtitan pads them for bf16 torch._grouped_mm


def symm_mem_why_not(ctx: RunContext, impl: str) -> str:
    """Why the all_to_all_vdev_2d baseline cannot run here ("" where it can)."""
    if ctx.device.type != "cuda":
        return "CPU ranks: torch.ops.symm_mem.all_to_all_vdev_2d runs on CUDA with NVSHMEM"
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
    if impl != "torch._grouped_mm":
        return f"the grouped GEMM here is {impl}, which reads the counts on the host"
    return ""


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
        self.in_splits.copy_(torch.bincount(ids, minlength=self.e))
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


def deepep_why_not(ctx: RunContext, impl: str) -> str:
    if ctx.device.type != "cuda":
        return "CPU ranks: DeepEP runs on CUDA"
    if importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not installed (bench/moe_baselines.py: how to build it on the GPU host)"
    return ""


class DeepEpPath:
    """DeepEP V1's intranode dispatch and combine around the expert MLP."""

    def __init__(self, ctx: RunContext, shape: tuple[int, ...]):
        import deep_ep

        _, h, e, _, _ = shape
        group = ctx.group or dist.group.WORLD
        size = group.size()
        hidden_bytes = h * 2
        nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, size)
                  for config in (deep_ep.Buffer.get_dispatch_config(size), deep_ep.Buffer.get_combine_config(size)))  # fmt: skip
        self.buffer, self.e = deep_ep.Buffer(group, nvl, 0), e

    def layer(self, s: Any, experts: Any, impl: str) -> torch.Tensor:
        from bench import moe

        b = self.buffer
        per_rank, per_rdma, per_expert, in_rank, _ = b.get_dispatch_layout(s.topk_ids, self.e)
        recv_x, recv_ids, recv_w, counts, handle, _ = b.dispatch(
            s.x, topk_idx=s.topk_ids, topk_weights=s.topk_weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        )  # fmt: skip
        # One row per received token; its pairs here are the slots with a local expert id.
        k = recv_ids.shape[1]
        flat = recv_ids.reshape(-1)
        order = torch.argsort(torch.where(flat >= 0, flat, len(counts)), stable=True)[: sum(counts)]
        ends = moe.group_ends_of(list(counts), s.x.device)
        y = moe.expert_mlp(recv_x[order // k], list(counts), ends, experts, impl)
        weights = recv_w.reshape(-1)[order].float()[:, None]
        rows = torch.zeros(recv_x.shape[0], y.shape[1], device=y.device, dtype=torch.float32)
        rows = rows.index_add_(0, order // k, y.float() * weights).to(y.dtype)
        out, _, _ = b.combine(rows, handle)
        return out


def baseline_variants(
    ctx: RunContext,
    shape: tuple[int, ...],
    sets: list[Any],
    experts: Any,
    refs: dict[str, Any],
    impl: str,
    most_received: int,
) -> tuple[list[Variant], dict[str, Check]]:
    """symm_mem_layer and deepep_layer for one shape, each skipped with the reason where it
    cannot run here; ``most_received``: the most pairs any rank receives in any set."""
    variants: list[Variant] = []
    checks: dict[str, Check] = {}
    made: dict[str, Any] = {}
    why = symm_mem_why_not(ctx, impl)
    if not why:
        try:
            path = SymmMemPath(ctx, shape, most_received)
            made["symm_mem_layer"] = (lambda s, p=path: p.layer(s, experts), {"symm_mem_backend": "NVSHMEM", "major_align": ALIGN})  # fmt: skip
        except Exception as err:  # noqa: BLE001 - recorded; the other variants still run
            why = f"set-up raised {type(err).__name__}: {err}"[:2000]
    if why:
        variants.append(unavailable("symm_mem_layer", "error" if why.startswith("set-up") else "skipped", why))  # fmt: skip
    why = deepep_why_not(ctx, impl)
    if not why:
        try:
            path = DeepEpPath(ctx, shape)
            made["deepep_layer"] = (
                lambda s, p=path: p.layer(s, experts, impl),
                {"grouped_mm": impl},
            )
        except Exception as err:  # noqa: BLE001
            why = f"set-up raised {type(err).__name__}: {err}"[:2000]
    if why:
        variants.append(unavailable("deepep_layer", "error" if why.startswith("set-up") else "skipped", why))  # fmt: skip
    for name, (call, config) in made.items():
        variants.append(Variant(name, cycled(sets, call), config=config))
        checks[name] = Check(lambda call=call: call(sets[0]), refs["nccl_layer"], "nccl_layer")
    order = {n: i for i, n in enumerate(BASELINES)}
    variants.sort(key=lambda v: order[v.name])
    return variants, checks


__all__ = ["BASELINES", "baseline_variants"]
