"""Repeated calls of one signature (ops/repeats.py): gemm_ar's repeats run the
path the signature's full call ran, with right results, and hand a call back
to the full path where an address or the state says they must.

Each test counts the calls that took gemm_ar's full path (a wrapper around
``gemm_ar._gemm_ar``), so a repeat that silently ran the full path, or one
that ran where it must not, fails.
"""

from __future__ import annotations

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank
from test_gemm_rs_ar import check_sum

from overlap_kernels.launch import run_ranks

# Fixed paths (each final from its first call), the template's "auto" (the
# interpreter's takes one_shot up to 16 rows, two_shot above) and the decode
# choice measured, then settled in place with each candidate run as its
# repeats run (the CUDA template's; on CPU only here).
CONFIGS = (
    {"path": "one_shot", "timeout_s": 20.0},
    {"path": "two_shot", "mechanism": "push", "timeout_s": 20.0},
    {"path": "two_shot", "mechanism": "copy_engine", "timeout_s": 20.0},
    {"path": "sequential"},
    None,
    {"decode": "fastest", "timeout_s": 20.0},
)


def _count_full_calls(module):
    """Wrap the op's full path; the list that counts its calls."""
    calls = []
    full = module._gemm_ar

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return full(*args, **kwargs)

    module._gemm_ar = counted
    return calls


def repeats_body(rank, world, use_gpu):
    import overlap_kernels as ok
    from overlap_kernels.ops import gemm_ar as module
    from overlap_kernels.ops.fastest import unsettled_calls
    from overlap_kernels.runtime.workspace import get_workspace

    dist, device = setup_rank(rank, use_gpu)
    dtype = torch.bfloat16 if use_gpu else torch.float32
    full_calls = _count_full_calls(module)
    shapes = ((8, 48, 40), (24, 32, 56))  # (M, K_local, N): ragged against the 16 x 32 tiles
    for config in CONFIGS:
        # Each signature's first call, and where it measures a choice (the
        # template's "fastest" on GPUs), the calls until that choice settles
        # and one more (the calls timed in place leave no repeat).
        for m, k, n in shapes:
            settling = True
            while settling:
                settling = unsettled_calls("gemm_ar") > 0
                x = torch.randn(m, k, dtype=dtype, device=device)
                w = torch.randn(k, n, dtype=dtype, device=device)
                check_sum(dist, ok.gemm_ar(x, w, config=config), x, w, what=f"{config} {m}x{k}x{n} first")
                settling = settling or unsettled_calls("gemm_ar") > 0
        full_calls.clear()
        # Then the two signatures in an uneven order (each meets both buffer
        # halves), fresh inputs every call: right, and none takes the full path.
        for m, k, n in (shapes[0], shapes[0], shapes[1], shapes[0], shapes[1], shapes[1]):
            x = torch.randn(m, k, dtype=dtype, device=device)
            w = torch.randn(k, n, dtype=dtype, device=device)
            check_sum(dist, ok.gemm_ar(x, w, config=config), x, w, what=f"{config} {m}x{k}x{n}")
        assert full_calls == [], (config, full_calls)
        for m, k, n in shapes:
            repeat = module._repeats.get(module._repeats.key(torch.empty(m, k, dtype=dtype, device=device),
                                                             torch.empty(k, n, dtype=dtype, device=device), None, config))  # fmt: skip
            assert repeat is not None and len(getattr(repeat, "plans", "..")) == 2, (config, m, repeat)

    # Addresses and state that a repeat must answer for.
    config = {"path": "one_shot", "timeout_s": 20.0}
    m, k, n = shapes[0]
    w = torch.randn(k, n, dtype=dtype, device=device)
    full_calls.clear()  # (the signature's repeat is kept from above)
    # x at an odd address, with the signature's shape and strides, on one rank
    # only: the repeat copies it, as the full path would.
    x = torch.randn(m * k + 1, dtype=dtype, device=device)[rank % 2 :][: m * k].view(m, k)
    check_sum(dist, ok.gemm_ar(x, w, config=config), x, w, what="unaligned x")
    assert len(full_calls) == 0
    # reset_workspaces() forgets the repeats (they hold workspaces): the full path makes the new one.
    ok.reset_workspaces()
    x = torch.randn(m, k, dtype=dtype, device=device)
    check_sum(dist, ok.gemm_ar(x, w, config=config), x, w, what="after reset_workspaces")
    assert len(full_calls) == 1
    check_sum(dist, ok.gemm_ar(x, w, config=config), x, w, what="repeat after reset_workspaces")
    assert len(full_calls) == 1  # the new workspace's repeat
    # The workspace grown by another call: the repeat makes the new buffer's plans.
    ws = get_workspace(None, device)
    buffer = ws.buffer
    ws.begin("test", 2 * ws.data_capacity, 20.0)  # every rank alike: an epoch of its own
    ws.finish()
    assert ws.buffer is not buffer
    check_sum(dist, ok.gemm_ar(x, w, config=config), x, w, what="repeat after the workspace grew")
    assert len(full_calls) == 1
    assert module._repeats.get(module._repeats.key(x, w, None, config)).buffer is ws.buffer
    # An out argument always takes the full path (its overlap with x depends on addresses).
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    check_sum(dist, ok.gemm_ar(x, w, config=config, out=out), x, w, what="out given")
    assert len(full_calls) == 2
    return len(full_calls)


@pytest.mark.parametrize("world", [2, 3])
def test_repeats_are_right_and_skip_the_full_path_cpu(world):
    assert run_ranks(repeats_body, world, False) == [2] * world


def timeout_body(rank, world, use_gpu):
    """A peer that stops calling fails a repeat as it fails a full call: the
    error names op, rank and peer; the next call raises it too."""
    import overlap_kernels as ok
    from overlap_kernels.ops import gemm_ar as module

    dist, device = setup_rank(rank, use_gpu)
    full_calls = _count_full_calls(module)
    x = torch.randn(8, 32, dtype=torch.float32, device=device)
    w = torch.randn(32, 16, dtype=torch.float32, device=device)
    config = {"path": "one_shot", "timeout_s": 3.0}
    for _ in range(2):  # the full call, then a repeat
        check_sum(dist, ok.gemm_ar(x, w, config=config), x, w, what="before the silence")
    raised = 0
    if rank == 0:
        assert len(full_calls) == 1
        for _ in range(2):
            with pytest.raises(ok.OverlapTimeoutError, match=r"^gemm_ar: rank 0 waited more than 3 s for rank 1 ") as e:
                ok.gemm_ar(x, w, config=config)
                ok.raise_if_failed()  # on GPUs the error is read after the kernel ran
            assert (e.value.op, e.value.rank, e.value.peer) == ("gemm_ar", 0, 1)
            raised += 1
        assert len(full_calls) == 1  # the repeats raised
    dist.barrier()  # rank 1 stays alive (and mapped) while rank 0 waits in vain
    ok.reset_workspaces()
    return raised


def test_silent_peer_fails_a_repeat_with_the_timeout_cpu():
    assert run_ranks(timeout_body, 2, False) == [2, 0]


@gpu_ranks(worlds=(2, 4))
def test_repeats_are_right_and_skip_the_full_path_gpu(world, gpus, backend):
    assert run_on_gpus(repeats_body, world, gpus, backend) == [2] * world


@gpu_ranks(worlds=(2,))
def test_silent_peer_fails_a_repeat_with_the_timeout_gpu(world, gpus, backend):
    assert run_on_gpus(timeout_body, world, gpus, backend) == [2, 0]


def test_a_repeat_never_outlives_the_process_group():
    """Without a process group (none yet, or destroyed) a call has no key a
    repeat is kept under: it takes the full path, which says what is wrong."""
    import torch.distributed as dist

    from overlap_kernels.ops.repeats import Repeats

    assert not dist.is_initialized()
    repeats = Repeats()
    key = repeats.key(torch.ones(2, 2), torch.ones(2, 2), None, None)
    repeats.keep(key, lambda x, w: x)
    assert repeats.get(key) is None
