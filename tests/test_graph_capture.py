"""CUDA graph capture: while a graph is captured the ops take their plain path
(NCCL and cuBLAS replay correctly; a fused call's flags carry its own epoch,
which a replay would repeat), so every replay is right; a step that needs the
symmetric workspace (MoE dispatch) refuses with a clear error. GPUs only:
Triton's interpreter has no graphs."""

from __future__ import annotations

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank, shares_gpus
from test_gemm_rs_ar import _gather, _rows, check_sum

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import check_matmul

REPLAYS = 3


def capture_body(rank, world, use_gpu):
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    w = torch.randn(256, 384, **bf16)
    x_ag, x_rs, x_decode = torch.randn(128, 256, **bf16), torch.randn(512, 256, **bf16), torch.randn(16, 256, **bf16)
    fused = {"path": "fused", "timeout_s": 20.0}
    calls = {  # the fused paths forced: eager, these are what would run
        "ag_gemm": (x_ag, lambda: ok.ag_gemm(x_ag, w, config=fused)),
        "gemm_rs": (x_rs, lambda: ok.gemm_rs(x_rs, w, config=fused)),
        "gemm_ar two_shot": (x_rs, lambda: ok.gemm_ar(x_rs, w, config={"path": "two_shot", "timeout_s": 20.0})),
        "gemm_ar one_shot": (x_decode, lambda: ok.gemm_ar(x_decode, w, config={"path": "one_shot", "timeout_s": 20.0})),
    }
    checked = 0
    for name, (x, call) in calls.items():
        call()  # eager first: kernels compiled, workspace and NCCL communicators made
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for replay in range(REPLAYS):
            x.copy_(torch.randn_like(x))  # new inputs in the captured buffers
            graph.replay()
            torch.cuda.synchronize()
            what = f"{name}, replay {replay}"
            if name == "ag_gemm":
                check_matmul(out, torch.cat(_gather(dist, x)), w, what)
            else:
                rows = _rows(rank, x.shape[0], world) if name == "gemm_rs" else slice(None)
                check_sum(dist, out, x, w, rows, what=what)
            checked += 1
    # Eager calls after the graph still take (and pass) the fused path.
    check_sum(dist, ok.gemm_rs(x_rs, w, config=fused), x_rs, w, _rows(rank, 512, world), what="gemm_rs after capture")
    ok.raise_if_failed()
    # MoE dispatch moves rows through the symmetric workspace itself: refused.
    ids = (torch.arange(8, device=device)[:, None] + torch.tensor([0, 1], device=device)) % (4 * world)
    weights = torch.rand(8, 2, device=device)
    ok.moe_dispatch(x_ag[:8], ids, weights, num_experts=4 * world)  # eager: the workspace exists
    torch.cuda.synchronize()
    refused = "moe_dispatch: its symmetric-memory steps cannot be captured"
    with pytest.raises(ok.OverlapInputError, match=refused), torch.cuda.graph(torch.cuda.CUDAGraph()):
        ok.moe_dispatch(x_ag[:8], ids, weights, num_experts=4 * world)
    return checked


@gpu_ranks(worlds=(2, 4))
def test_replays_of_a_captured_graph_are_right_gpu(world, gpus, backend):
    if shares_gpus(world, gpus):
        # Ranks on one GPU talk through gloo, whose collectives a CUDA graph
        # cannot hold, and while capturing the ops take their plain path.
        pytest.skip("the plain path's gloo collectives cannot be captured in a CUDA graph")
    assert run_on_gpus(capture_body, world, gpus, backend, timeout_s=300) == [4 * REPLAYS] * world  # four ops, each replayed


def test_capture_takes_the_plain_path_cpu(monkeypatch):
    # The decision alone (no GPU here): the plain path while capturing on CUDA, else the config as it was.
    from overlap_kernels.ops.gemm_rs import GemmRsConfig
    from overlap_kernels.ops.paths import plain_while_capturing

    cuda, cfg = torch.device("cuda", 0), GemmRsConfig(path="fused")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert plain_while_capturing("gemm_rs", cfg, cuda) is cfg
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert plain_while_capturing("gemm_rs", cfg, cuda).path == "sequential"
    assert plain_while_capturing("gemm_rs", cfg, torch.device("cpu")) is cfg
