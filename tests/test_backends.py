"""Symmetric-memory backends and rank placement: every backend holds a
workspace the fused ops run on, a reset lets it go, and a backend that cannot
serve (unknown, missing extra, wrong device, switched under a live workspace)
says so before anything is allocated."""

from __future__ import annotations

import gc
import importlib.util
import logging
import weakref

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank
from test_ag_gemm import _gather
from test_gemm_rs_ar import _rows, check_sum

import overlap_kernels as ok
from overlap_kernels.launch import gpu_placement, process_group_backend, run_ranks
from overlap_kernels.reference import check_matmul
from overlap_kernels.runtime.backends import make_backend


def test_ranks_are_placed_round_robin_and_shared_gpus_use_gloo():
    assert gpu_placement(4, 1) == [0, 0, 0, 0]
    assert gpu_placement(4, 2) == [0, 1, 0, 1]
    assert gpu_placement(3, 4) == [0, 1, 2]
    assert process_group_backend(4, 4) == "nccl" and process_group_backend(2, 4) == "nccl"
    assert process_group_backend(4, 1) == "gloo" and process_group_backend(2, 1) == "gloo"
    assert process_group_backend(2, 0) == "gloo"  # no GPU: CPU ranks
    with pytest.raises(ValueError, match="at least one rank and one GPU"):
        gpu_placement(2, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without GPUs")
def test_gpu_ranks_without_gpus_are_refused():
    with pytest.raises(ValueError, match="use_gpu=True, but this host has no CUDA GPU"):
        run_ranks(setup_rank, 2, True, use_gpu=True)


def test_backend_errors_name_the_way_out():
    with pytest.raises(
        ok.OverlapInputError,
        match=r"unknown symmetric-memory backend 'shm'; choose one of \['cupy', 'host', 'nvshmem', 'torch'\]",
    ):
        make_backend("shm", torch.device("cpu"))
    with pytest.raises(
        ok.OverlapInputError,
        match=r"backend 'torch' holds CUDA memory, but the tensors are on cpu; the default for CPU tensors is 'host'",
    ):
        make_backend("torch", torch.device("cpu"))
    with pytest.raises(
        ok.OverlapInputError,
        match=r"backend 'host' holds CPU memory, but the tensors are on cuda:0; the default for CUDA tensors is 'torch'",
    ):
        make_backend("host", torch.device("cuda", 0))
    with pytest.raises(
        ok.OverlapInputError, match="use_backend: torch.distributed is not initialised"
    ):
        ok.use_backend("host")


@pytest.mark.parametrize(
    "backend, module, extra", [("cupy", "cupy", "cupy"), ("nvshmem", "nvshmem", "nvshmem")]
)
def test_a_missing_extra_is_named(backend, module, extra):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    with pytest.raises(
        ok.OverlapInputError,
        match=rf"backend '{backend}' needs the Python module .* pip install 'overlap_kernels\[{extra}\]'",
    ):
        make_backend(backend, torch.device("cuda", 0))


def choice_body(rank, world, use_gpu):
    """A group's backend is chosen before its workspace exists; switching under
    a live workspace is refused until reset_workspaces(); a backend for other
    tensors is refused at the first op. gloo with CUDA tensors is accepted, and
    said once."""
    from overlap_kernels.ops.checks import check_group

    dist, device = setup_rank(rank, use_gpu)
    x, w = torch.randn(4, 16, device=device), torch.randn(16, 8, device=device)
    check_matmul(ok.ag_gemm(x, w, config={"path": "fused"}), _gather(dist, x), w, "host backend")
    with pytest.raises(
        ok.OverlapInputError,
        match="already holds its workspace in backend 'host'; call overlap_kernels.reset_workspaces",
    ):
        ok.use_backend("torch")
    ok.use_backend("host")  # the backend it has: nothing to switch
    ok.reset_workspaces()
    ok.use_backend("torch")
    with pytest.raises(
        ok.OverlapInputError, match="backend 'torch' holds CUDA memory, but the tensors are on cpu"
    ):
        ok.ag_gemm(x, w, config={"path": "fused"})
    ok.use_backend("host")
    check_matmul(
        ok.ag_gemm(x, w, config={"path": "fused"}), _gather(dist, x), w, "host backend again"
    )

    said = []
    handler = logging.Handler()
    handler.emit = said.append
    logging.getLogger("overlap_kernels.ops.checks").addHandler(handler)
    cuda = torch.device("cuda", 0)  # only the group check: nothing is launched
    assert check_group("gemm_ar", None, cuda) is dist.group.WORLD
    assert check_group("gemm_rs", None, cuda) is dist.group.WORLD
    assert len(said) == 1 and "gloo group with CUDA tensors" in said[0].getMessage(), said
    return True


def test_backend_choice_and_gloo_with_cuda_tensors_cpu():
    assert run_ranks(choice_body, 2, False) == [True, True]


def launch_scratch_body(rank, world, use_gpu):
    """Workspace.launch_scratch: a slot per stream inside this rank's buffer,
    below the data region; none past the last slot or a slot's size."""
    from overlap_kernels.limits import (
        DATA_OFFSET,
        FLAG_BYTES,
        SCRATCH_OFFSET,
        SCRATCH_SLOT_BYTES,
        SCRATCH_SLOTS,
    )
    from overlap_kernels.runtime.workspace import get_workspace

    _, device = setup_rank(rank, use_gpu)
    ws = get_workspace(None, device)
    base = ws.buffer.local.data_ptr()
    streams = range(1000, 1000 + SCRATCH_SLOTS)  # raw stream handles, as the launcher passes them
    slots = [ws.launch_scratch(stream, 4096) for stream in streams]
    assert slots == [base + SCRATCH_OFFSET + i * SCRATCH_SLOT_BYTES for i in range(SCRATCH_SLOTS)]
    assert SCRATCH_OFFSET >= FLAG_BYTES and slots[-1] + SCRATCH_SLOT_BYTES <= base + DATA_OFFSET
    assert [ws.launch_scratch(stream, 64) for stream in streams] == slots  # a stream keeps its slot
    assert ws.launch_scratch(2000, 64) is None  # every slot held by another stream
    assert ws.launch_scratch(1000, SCRATCH_SLOT_BYTES + 1) is None
    ok.reset_workspaces()
    ws = get_workspace(None, device)
    assert ws.launch_scratch(3000, SCRATCH_SLOT_BYTES + 1) is None  # too large: no slot taken
    assert ws.launch_scratch(3001, 64) == ws.buffer.local.data_ptr() + SCRATCH_OFFSET
    ok.reset_workspaces()
    return True


def test_launch_scratch_slots_cpu():
    assert run_ranks(launch_scratch_body, 1, False) == [True]


def fused_ops_body(rank, world, use_gpu, backend, sizes):
    """Every peer's bytes through the workspace's views, then each fused op on
    ``sizes`` (rows per rank; a large one grows the workspace), checked
    against float64; a reset lets the workspace go (its memory freed) and the
    next call makes a new one."""
    from overlap_kernels.runtime.workspace import get_workspace

    dist, device = setup_rank(rank, use_gpu)
    ws = get_workspace(None, device)
    assert ws.backend.name == backend, (ws.backend.name, backend)
    assert ws.peer_table.tolist() == [p.data_ptr() for p in ws.buffer.peers]
    mine = torch.arange(64, dtype=torch.float32, device=device) + 1000 * rank
    ws.data(rank, 0, (64,), torch.float32).copy_(mine)
    if use_gpu:
        torch.cuda.synchronize()
    dist.barrier()
    for peer in range(world):  # copy-engine reads of each peer's bytes
        seen = ws.data(peer, 0, (64,), torch.float32).clone()
        assert torch.equal(
            seen, torch.arange(64, dtype=torch.float32, device=device) + 1000 * peer
        ), (peer, seen)
    dist.barrier()  # nobody reads while the ops below overwrite

    dtype, (k, n) = (torch.bfloat16, (256, 384)) if use_gpu else (torch.float32, (32, 48))
    checked = 0
    for m_local in sizes if world > 1 else ():  # one rank: every op takes its plain path
        timeout = {"timeout_s": 60.0}
        w = torch.randn(k, n, dtype=dtype, device=device)
        x = torch.randn(m_local, k, dtype=dtype, device=device)
        check_matmul(
            ok.ag_gemm(x, w, config={"path": "fused", **timeout}),
            _gather(dist, x),
            w,
            f"ag_gemm {m_local}",
        )
        x = torch.randn(m_local * world, k, dtype=dtype, device=device)
        rows = _rows(rank, m_local * world, world)
        check_sum(
            dist,
            ok.gemm_rs(x, w, config={"path": "fused", **timeout}),
            x,
            w,
            rows,
            what=f"gemm_rs {m_local}",
        )
        check_sum(
            dist,
            ok.gemm_ar(x, w, config={"path": "two_shot", **timeout}),
            x,
            w,
            what=f"gemm_ar two_shot {m_local}",
        )
        x = torch.randn(16, k, dtype=dtype, device=device)
        check_sum(
            dist,
            ok.gemm_ar(x, w, config={"path": "one_shot", **timeout}),
            x,
            w,
            what="gemm_ar one_shot",
        )
        checked += 4
    ok.raise_if_failed()
    gone = [weakref.ref(ws)]
    if (
        backend == "cupy"
    ):  # every cudaMalloc'd block and opened handle: freed or closed when collected
        gone += [
            weakref.ref(block) for buffer in (ws.buffer, *ws._retired) for block in buffer.keepalive
        ]
    del ws
    ok.reset_workspaces()
    gc.collect()
    alive = [ref() for ref in gone if ref() is not None]
    assert not alive, f"reset_workspaces() left symmetric memory alive: {alive}"
    if world > 1:
        x = torch.randn(sizes[0], k, dtype=dtype, device=device)
        check_matmul(
            ok.ag_gemm(x, w, config={"path": "fused"}), _gather(dist, x), w, "ag_gemm after reset"
        )
        checked += 1
    return checked


def test_fused_ops_on_the_host_backend_cpu():
    assert run_ranks(fused_ops_body, 2, False, "host", (8,)) == [5, 5]


@gpu_ranks(backends=("torch", "cupy", "nvshmem"), backend_worlds=(1, 2, 4))
def test_fused_ops_on_every_backend_gpu(world, gpus, backend):
    # 512 rows per rank outgrow the first 1 MiB of data: the workspace grows once.
    expected = 4 * 2 + 1 if world > 1 else 0
    assert (
        run_on_gpus(fused_ops_body, world, gpus, backend, backend, (64, 512), timeout_s=240)
        == [expected] * world
    )


@gpu_ranks(worlds=(2, 4), backends=("nvshmem",))
def test_moe_ops_on_nvshmem_gpu(world, gpus, backend):
    # The MoE ops on the NVSHMEM heap (the full suite runs them on torch and cupy).
    from test_moe import GEMM_CASES, gemm_body

    assert run_on_gpus(gemm_body, world, gpus, backend) == [4 * len(GEMM_CASES)] * world
