"""CUDA graph capture: every fused path of ag_gemm, gemm_rs and gemm_ar replays
(its epoch counted on the device: ops/replay.py), and a plan whose replay no
eager call prepared takes its plain path while a graph is captured (NCCL and
cuBLAS replay correctly), so every replay is right; a step that needs the
symmetric workspace (MoE dispatch) refuses with a clear error. Triton's
interpreter has no graphs: on the CPU the replay steps are run as a replay
would run them."""

from __future__ import annotations

import time

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank
from test_gemm_rs_ar import _gather, _rows, check_op, check_sum

from overlap_kernels.launch import run_ranks
from overlap_kernels.limits import REPLAY_EPOCH_SLOT
from overlap_kernels.ops.replay import REPLAY_MAX_BYTES
from overlap_kernels.reference import check_matmul

REPLAYS = 3
REPLAYS_CHECKED = 100  # replays of one captured graph, each with new inputs


def capture_body(rank, world, use_gpu):
    """Each op's default fused path captured in one graph after an eager call,
    replayed on new inputs and checked; eager calls fuse after it."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    w = torch.randn(256, 384, **bf16)
    x_ag, x_rs, x_decode = (
        torch.randn(128, 256, **bf16),
        torch.randn(512, 256, **bf16),
        torch.randn(16, 256, **bf16),
    )
    fused = {"path": "fused", "timeout_s": 20.0}
    calls = {  # the fused paths forced: eager, these are what would run
        "ag_gemm": (x_ag, lambda: ok.ag_gemm(x_ag, w, config=fused)),
        "gemm_rs": (x_rs, lambda: ok.gemm_rs(x_rs, w, config=fused)),
        "gemm_ar two_shot": (
            x_rs,
            lambda: ok.gemm_ar(x_rs, w, config={"path": "two_shot", "timeout_s": 20.0}),
        ),
        "gemm_ar one_shot": (
            x_decode,
            lambda: ok.gemm_ar(x_decode, w, config={"path": "one_shot", "timeout_s": 20.0}),
        ),
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
    check_sum(
        dist,
        ok.gemm_rs(x_rs, w, config=fused),
        x_rs,
        w,
        _rows(rank, 512, world),
        what="gemm_rs after capture",
    )
    ok.raise_if_failed()
    # MoE dispatch moves rows through the symmetric workspace itself: refused.
    ids = (torch.arange(8, device=device)[:, None] + torch.tensor([0, 1], device=device)) % (
        4 * world
    )
    weights = torch.rand(8, 2, device=device)
    ok.moe_dispatch(x_ag[:8], ids, weights, num_experts=4 * world)  # eager: the workspace exists
    torch.cuda.synchronize()
    refused = "moe_dispatch: its symmetric-memory steps cannot be captured"
    with (
        pytest.raises(ok.OverlapInputError, match=refused),
        torch.cuda.graph(torch.cuda.CUDAGraph()),
    ):
        ok.moe_dispatch(x_ag[:8], ids, weights, num_experts=4 * world)
    return checked


@gpu_ranks(worlds=(2, 4))
def test_replays_of_a_captured_graph_are_right_gpu(world, gpus, backend):
    # (Ranks sharing a GPU talk through gloo, whose collectives a graph cannot
    # hold: this also shows that no captured call fell back to its plain path.)
    assert (
        run_on_gpus(capture_body, world, gpus, backend, timeout_s=300) == [4 * REPLAYS] * world
    )  # four ops, each replayed


# name -> (op, config, flags of its signature after the schedule): every fused path replays
REPLAYED = {
    "gemm_ar one_shot": ("gemm_ar", {"path": "one_shot"}, ()),
    "gemm_ar two_shot": ("gemm_ar", {"path": "two_shot"}, ()),
    "gemm_ar two_shot copy_engine": (
        "gemm_ar",
        {"path": "two_shot", "mechanism": "copy_engine", "comm_sms": 1},
        (),
    ),
    "gemm_ar two_shot push cublas": (
        "gemm_ar",
        {"path": "two_shot", "mechanism": "push", "producer": "cublas", "lag": None},
        (),
    ),
    "gemm_rs push": (
        "gemm_rs",
        {"path": "fused", "mechanism": "push", "producer": "triton"},
        ("sum",),
    ),
    "gemm_rs copy_engine": (
        "gemm_rs",
        {"path": "fused", "mechanism": "copy_engine", "comm_sms": 1},
        ("sum",),
    ),
    "gemm_rs push cublas": (
        "gemm_rs",
        {"path": "fused", "mechanism": "push", "producer": "cublas", "lag": None},
        ("sum",),
    ),
    "gemm_rs cublas": (
        "gemm_rs",
        {"path": "fused", "mechanism": "copy_engine", "producer": "cublas", "comm_sms": 1},
        ("sum",),
    ),
    "ag_gemm copy_engine": (
        "ag_gemm",
        {"path": "fused", "mechanism": "copy_engine", "gemm": "triton"},
        (),
    ),
    "ag_gemm sm_copy": ("ag_gemm", {"path": "fused", "mechanism": "sm_copy", "gemm": "triton"}, ()),
    "ag_gemm push": ("ag_gemm", {"path": "fused", "mechanism": "push", "gemm": "triton"}, ()),
    "ag_gemm cublas": (
        "ag_gemm",
        {"path": "fused", "mechanism": "copy_engine", "gemm": "cublas"},
        (),
    ),
}
# One path per kind of wait a skipped replay must time out: a reduction's
# per-tile wait, a copy's wait kernel, the announcement of gathered rows,
# the wait for pushed rows.
SKIPPED = ("gemm_ar one_shot", "gemm_rs copy_engine", "ag_gemm copy_engine", "ag_gemm push")


def replay_body(rank, world, use_gpu, name, replays, skipping_rank):
    """A fused path of REPLAYED run as a captured graph runs it, ``replays``
    times with new inputs each time, every result checked against float64;
    where a rank skips a replay, its peers get the timeout error (not a hang).
    On GPUs a real graph is captured once and replayed; on the CPU the replay
    steps run directly, and the last rank starts each replay's work late, so
    that its peers' waits must hold for data of this very replay."""
    import overlap_kernels as ok
    from overlap_kernels.ops import plans

    op, fields, flags = REPLAYED[name]
    dist, device = setup_rank(rank, use_gpu)
    dtype = torch.bfloat16 if use_gpu else torch.float32
    m = 16 if op != "ag_gemm" else 8  # (ag_gemm: this rank's rows)
    x, w = (
        torch.randn(m, 64, dtype=dtype, device=device),
        torch.randn(64, 48, dtype=dtype, device=device),
    )
    config = {**fields, "timeout_s": 3.0 if skipping_rank is not None else 20.0}
    call = getattr(ok, op)

    def check(out, what):
        check_op(dist, op, out, x, w, what)

    check(call(x, w, config=config), "eager")  # makes the plan (and, on CUDA, prepares replay)
    plan = plans.cached(plans.signature(op, x, w, None, config, None, *flags))
    if use_gpu:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(x, w, config=config)
        replay = graph.replay
    else:  # what CUDA's eager call and capture do
        out = torch.empty(plan.out_shape, dtype=dtype)
        if rank == world - 1 and skipping_rank is None:
            _enter_late(0.5)
        if op == "ag_gemm":
            plan.prepare_replay(x, plan.cfg)

            def replay():
                assert plan.replay(x, w, out) is not None
        else:
            plan.fused.prepare_replay(x, w, out, plan.cfg)

            def replay():
                assert plan.fused.replay(x, w, out, plan.word, plan.cfg)

    # What a captured graph addresses stays while the workspace does, however the plan
    # cache evicts; the replay buffer is reserved whole, so it never moves under a graph.
    state = plan.replay_state if op == "ag_gemm" else plan.fused.replay_state
    assert any(kept is state for kept in state.ws.replay_states)
    assert state.ws.data_capacity >= REPLAY_MAX_BYTES
    # Each fused replay counts its epochs on the device: one, or two for ag_gemm's pulls
    # (its entry, then the announcement of its rows). A plain fallback counts none.
    per_replay = 2 if op == "ag_gemm" and not state.one_launch else 1
    epochs = int(state.ws.chunk_flags[REPLAY_EPOCH_SLOT])
    done = 0
    for i in range(replays):
        x.copy_(torch.randn_like(x))  # new inputs in the captured buffer
        if i == 1 and skipping_rank is not None:
            if rank != skipping_rank:
                replay()
                with pytest.raises(
                    ok.OverlapTimeoutError,
                    match=rf"^{op} \(replayed in a CUDA graph\): rank 0 waited more than 3 s",
                ):
                    ok.raise_if_failed()  # (synchronises first)
                done += 1
            break
        replay()
        check(out, f"replay {i}")
        done += 1
        replayed = int(state.ws.chunk_flags[REPLAY_EPOCH_SLOT]) - epochs
        assert replayed == per_replay * done, (
            f"{name}: {replayed} device epochs after {done} replays"
        )
    dist.barrier()  # the skipping rank stays alive (and mapped) while its peers wait in vain
    ok.reset_workspaces()
    return done


def _enter_late(seconds: float) -> None:
    """Have this rank process start each replayed call's work ``seconds`` after entering it."""
    from overlap_kernels.ops.replay import ReplayState

    enter = ReplayState.enter

    def late(state, word):
        enter(state, word)
        time.sleep(seconds)

    ReplayState.enter = late


@pytest.mark.parametrize("name", sorted(REPLAYED))
def test_replays_are_right_cpu(name):
    assert run_ranks(replay_body, 2, False, name, 3, None) == [3, 3]


@pytest.mark.parametrize("name", SKIPPED)
def test_a_skipped_replay_gives_the_timeout_cpu(name):
    assert run_ranks(replay_body, 2, False, name, 3, 1) == [2, 1]


@pytest.mark.parametrize("name", sorted(REPLAYED))
@gpu_ranks(worlds=(2, 4))
def test_replays_are_right_gpu(world, gpus, backend, name):
    assert (
        run_on_gpus(replay_body, world, gpus, backend, name, REPLAYS_CHECKED, None)
        == [REPLAYS_CHECKED] * world
    )


@pytest.mark.parametrize("name", SKIPPED)
@gpu_ranks(worlds=(2,))
def test_a_skipped_replay_gives_the_timeout_gpu(world, gpus, backend, name):
    assert run_on_gpus(replay_body, world, gpus, backend, name, 3, 1) == [2, 1]


def replayed_mismatch_body(rank, world, use_gpu):
    """Two gemm_ar signatures prepared (and, on GPUs, captured) on every rank; then
    rank 0 replays one and its peers the other: the replays' entries carry each
    plan's signature word, and every rank raises OverlapMismatchError, not a
    wrong sum or a timeout."""
    import overlap_kernels as ok
    from overlap_kernels.ops import plans

    dist, device = setup_rank(rank, use_gpu)
    w = torch.randn(32, 16, device=device)
    config = {"path": "one_shot", "timeout_s": 20.0}
    replays = []
    for m in (8, 16):
        x = torch.randn(m, 32, device=device)
        ok.gemm_ar(x, w, config=config)  # the plan, and on CUDA its replay prepared
        plan = plans.cached(plans.signature("gemm_ar", x, w, None, config, None))
        out = torch.empty(plan.out_shape, device=device)
        if use_gpu:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ok.gemm_ar(x, w, config=config, out=out)
            replays.append(graph.replay)
        else:  # what CUDA's eager call and capture do
            plan.fused.prepare_replay(x, w, out, plan.cfg)
            replays.append(
                lambda plan=plan, x=x, out=out: plan.fused.replay(x, w, out, plan.word, plan.cfg)
            )
    start = time.monotonic()
    replays[0 if rank == 0 else 1]()
    with pytest.raises(
        ok.OverlapMismatchError,
        match=r"^gemm_ar \(replayed in a CUDA graph\): rank \d and rank \d ran different calls.* "
        r"They differ in x \(\[(8, 32\] float32 vs \[16|16, 32\] float32 vs \[8), 32\] float32\)",
    ):
        ok.raise_if_failed()  # (synchronises first)
    took = time.monotonic() - start
    dist.barrier()
    ok.reset_workspaces()
    return took


def test_ranks_replaying_different_graphs_raise_cpu():
    assert all(t < 10.0 for t in run_ranks(replayed_mismatch_body, 2, False))


@gpu_ranks(worlds=(2,))
def test_ranks_replaying_different_graphs_raise_gpu(world, gpus, backend):
    assert all(t < 10.0 for t in run_on_gpus(replayed_mismatch_body, world, gpus, backend))


def plain_while_capturing_body(rank, world, use_gpu):
    """A fused plan whose replay no eager call prepared (on the CPU none is),
    called while a graph is "captured", runs its plain path: right, and no
    fused epoch is spent; the same plan fuses again once capture ends."""
    import overlap_kernels as ok
    from overlap_kernels.ops.reduce_details import run as module
    from overlap_kernels.runtime.workspace import get_workspace

    dist, device = setup_rank(rank, use_gpu)
    x, w = torch.randn(8, 32, device=device), torch.randn(32, 16, device=device)
    config = {"path": "fused", "mechanism": "copy_engine", "comm_sms": 1, "timeout_s": 20.0}
    check_sum(dist, ok.gemm_rs(x, w, config=config), x, w, _rows(rank, 8, world), what="fused")
    epoch = get_workspace(None, device).epoch
    original, module.capturing = module.capturing, lambda device: True
    check_sum(
        dist, ok.gemm_rs(x, w, config=config), x, w, _rows(rank, 8, world), what="while capturing"
    )
    assert get_workspace(None, device).epoch == epoch
    module.capturing = original
    check_sum(
        dist, ok.gemm_rs(x, w, config=config), x, w, _rows(rank, 8, world), what="after capture"
    )
    return get_workspace(None, device).epoch - epoch


def graph_path_body(rank, world, use_gpu):
    """gemm_ar's graph_path "sequential" (a tuned table's, where the captured pair
    replayed faster): while a graph is "captured" the plan runs the plain pair at
    once, right, without trying its replay or saying it falls back; "same" tries
    the replay first (unprepared on the CPU: the plain path, said)."""
    import overlap_kernels as ok
    from overlap_kernels.ops.reduce_details import run as module

    dist, device = setup_rank(rank, use_gpu)
    x, w = torch.randn(8, 32, device=device), torch.randn(32, 16, device=device)
    tried = []
    replay, say, capturing = (
        module.FusedReduce.replay,
        module.say_plain_while_capturing,
        module.capturing,
    )
    module.FusedReduce.replay = lambda self, *args: tried.append("replay") or False
    module.say_plain_while_capturing = lambda op: tried.append("said")
    module.capturing = lambda device: True
    try:
        for graph_path in ("sequential", "same"):
            config = {"path": "one_shot", "graph_path": graph_path, "timeout_s": 20.0}
            check_sum(dist, ok.gemm_ar(x, w, config=config), x, w, what=graph_path)
            tried.append(graph_path)
    finally:
        module.FusedReduce.replay, module.say_plain_while_capturing = replay, say
        module.capturing = capturing
    return tried


def test_a_config_sends_captured_calls_to_the_plain_pair_cpu():
    assert run_ranks(graph_path_body, 2, False) == [["sequential", "replay", "said", "same"]] * 2


def test_capture_takes_the_plain_path_cpu(monkeypatch):
    # The decision (no GPU here): capturing on CUDA when the stream captures, never on CPU.
    from overlap_kernels.ops import paths

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(paths, "stream_capturing", lambda: False)
    assert not paths.capturing(cuda)
    monkeypatch.setattr(paths, "stream_capturing", lambda: True)
    assert paths.capturing(cuda) and not paths.capturing(torch.device("cpu"))
    # And what a plan does with it.
    assert run_ranks(plain_while_capturing_body, 2, False) == [1, 1]


def compiled_replay_body(rank, world, use_gpu):
    """torch.compile(mode="reduce-overhead") around gemm_ar at a decode size: the
    custom op is captured in torch's CUDA graph (one_shot replays) and every
    call, on new inputs, is right. The op runs once eagerly first, outside the
    compiled function: its set-up (workspaces, plan, replay preparation) must
    not land in the memory pool of torch's graph warm-up, which refuses tensors
    that outlive it."""
    import overlap_kernels.integrations.torch_ops  # noqa: F401 - registers torch.ops.overlap_kernels

    dist, device = setup_rank(rank, use_gpu)
    w = torch.randn(64, 48, dtype=torch.bfloat16, device=device)
    group_name = dist.group.WORLD.group_name

    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    check_sum(dist, torch.ops.overlap_kernels.gemm_ar(x, w, group_name), x, w, what="eager")

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(x):
        return torch.ops.overlap_kernels.gemm_ar(x, w, group_name) * 2

    from overlap_kernels.runtime.workspace import _WORKSPACES

    eager_ws = _WORKSPACES[(group_name, str(device))]
    replay_ws = _WORKSPACES[(group_name, f"{device}/replay")]
    eager_before, replayed_before = eager_ws.epoch, int(replay_ws.chunk_flags[REPLAY_EPOCH_SLOT])
    calls = 8  # warm-up, recording, then replays
    for i in range(calls):
        x = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
        out = step(x).clone()  # (a graph's output is overwritten by its next replay)
        check_sum(dist, out / 2, x, w, what=f"compiled call {i}")
    torch.cuda.synchronize()
    # Every call ran fused (the plain pair would be right too): eagerly (torch's
    # warm-up) or replayed, each counted by its workspace's epoch.
    eager = eager_ws.epoch - eager_before
    replayed = int(replay_ws.chunk_flags[REPLAY_EPOCH_SLOT]) - replayed_before
    return eager, replayed, calls


@gpu_ranks(worlds=(2,), backends=("torch",))
def test_reduce_overhead_compile_replays_gemm_ar_gpu(world, gpus, backend):
    for eager, replayed, calls in run_on_gpus(compiled_replay_body, world, gpus, backend):
        assert eager + replayed >= calls and replayed >= calls - 2, (eager, replayed, calls)


# ---- a decoder layer's two reduction points in one graph ----------------------


def layer_body(rank, world, use_gpu, replays, skipping_rank):
    """A decoder layer's reduction points captured in one graph: o_proj as
    gemm_ar_rmsnorm, down_proj as cuBLAS then all_reduce_rmsnorm, and a
    gemm_ar (one_shot) beside them: three one-launch fused calls that replay
    with no entry barrier (ops/replay.py). Every replay, on new inputs, is
    checked against float64; the replay workspace's device epoch then counts
    exactly the fused calls replayed (a plain fallback would replay right too).
    With a ``skipping_rank``, that rank skips one replay: its peers get
    OverlapTimeoutError within about one configured deadline (not one per
    call), and after reset_workspaces() a fresh eager call works on every rank.
    On the CPU the replay steps run as a replay runs them (the last rank
    starting each late)."""
    import overlap_kernels as ok
    from overlap_kernels.limits import REPLAY_EPOCH_SLOT
    from overlap_kernels.ops import all_reduce as all_reduce_module
    from overlap_kernels.ops import paths, plans
    from overlap_kernels.ops.reduce_details import run as reduce_module
    from overlap_kernels.reference import check_add_rmsnorm
    from overlap_kernels.runtime.workspace import _WORKSPACES

    dist, device = setup_rank(rank, use_gpu)
    dtype = torch.bfloat16 if use_gpu else torch.float32
    m, hidden, k_o, k_down = 4, 48, 32, 64
    deadline = 3.0 if skipping_rank is not None else 20.0
    config = {"path": "one_shot", "block_cols": 16, "timeout_s": deadline}
    ar_config = {"path": "one_shot", "timeout_s": deadline}

    def new(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    x_o, w_o = new(m, k_o), new(hidden, k_o).t()  # weights in nn.Linear's layout
    x_down, w_down = new(m, k_down), new(hidden, k_down).t()
    residual, norm1, norm2 = new(m, hidden), new(hidden), new(hidden)
    for t in (residual, norm1, norm2):
        dist.broadcast(t, 0)

    def layer():
        h1, r1 = ok.gemm_ar_rmsnorm(x_o, w_o, residual, norm1, 1e-5, config=config)
        h2, r2 = ok.all_reduce_rmsnorm(torch.matmul(x_down, w_down), r1, norm2, 1e-5, config=config)
        return h1, r1, h2, r2, ok.gemm_ar(x_down, w_down, config=ar_config)

    def check(outs, what):
        h1, r1, h2, r2, y = (t.cpu() for t in outs)
        # Each rank's partials are its own torch.matmul products, as the ops' are.
        o_parts = [p.cpu() for p in _gather(dist, torch.matmul(x_o, w_o))]
        down_parts = [p.cpu() for p in _gather(dist, torch.matmul(x_down, w_down))]
        check_add_rmsnorm(h1, r1, o_parts, residual.cpu(), norm1.cpu(), 1e-5, f"{what}: o_proj")
        check_add_rmsnorm(h2, r2, down_parts, r1, norm2.cpu(), 1e-5, f"{what}: down_proj")
        check_sum(dist, y.to(device), x_down, w_down, what=f"{what}: gemm_ar")

    check(layer(), "eager")  # plans made, replays prepared (on CUDA)
    if use_gpu:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = layer()
        replay = graph.replay
    else:  # what CUDA's eager call and capture do
        for key in list(plans._cache(dist.group.WORLD)):
            if key[0] in ("gemm_ar_rmsnorm", "all_reduce_rmsnorm"):
                plans.cached(key).prepare_replay()
        gemm_ar_plan = plans.cached(
            plans.signature("gemm_ar", x_down, w_down, None, ar_config, None)
        )
        out = torch.empty(m, hidden, dtype=dtype)
        gemm_ar_plan.fused.prepare_replay(x_down, w_down, out, gemm_ar_plan.cfg)
        if rank == world - 1 and skipping_rank is None:
            _enter_late(0.5)
        all_reduce_module.capturing = reduce_module.capturing = lambda device: True
        outs = None

        def replay():
            nonlocal outs
            outs = layer()

    epoch_word = None
    done = 0
    for i in range(replays):
        for t in (x_o, x_down):
            t.copy_(torch.randn_like(t))  # new inputs in the captured buffers
        if i == 1 and skipping_rank is not None:
            if rank != skipping_rank:
                start = time.monotonic()
                replay()
                with pytest.raises(
                    ok.OverlapTimeoutError, match=rf"rank {rank} waited more than 3 s"
                ):
                    ok.raise_if_failed()  # (synchronises first)
                took = time.monotonic() - start
                # one deadline, not one per fused call of the graph (three)
                assert took < 2 * deadline, f"the skipped replay took {took:.1f} s to fail"
                done += 1
            break
        replay()
        check(outs, f"replay {i}")
        done += 1
        replay_ws = _WORKSPACES[(dist.group.WORLD.group_name, f"{device}/replay")]
        epoch_word = int(replay_ws.chunk_flags[REPLAY_EPOCH_SLOT])
    dist.barrier()  # the skipping rank stays alive (and mapped) while its peers wait in vain
    if skipping_rank is None:
        assert epoch_word == 3 * replays, (
            f"the device counted {epoch_word} fused calls, not {3 * replays}"
        )
    ok.reset_workspaces()
    all_reduce_module.capturing = reduce_module.capturing = paths.capturing
    check(layer(), "eager after reset_workspaces()")
    return done


def test_a_layer_replays_fused_cpu():
    assert run_ranks(layer_body, 2, False, 3, None) == [3, 3]


def test_a_layer_replay_skipped_gives_the_timeout_cpu():
    assert run_ranks(layer_body, 2, False, 3, 1) == [2, 1]


@gpu_ranks(worlds=(2, 4))
def test_a_layer_replays_fused_gpu(world, gpus, backend):
    assert (
        run_on_gpus(layer_body, world, gpus, backend, REPLAYS_CHECKED, None)
        == [REPLAYS_CHECKED] * world
    )


@gpu_ranks(worlds=(2,))
def test_a_layer_replay_skipped_gives_the_timeout_gpu(world, gpus, backend):
    assert run_on_gpus(layer_body, world, gpus, backend, 3, 1) == [2, 1]


def unaligned_out_body(rank, world, use_gpu):
    """A caller's ``out`` that TMA cannot store to (a view one element in) makes
    the call take the pointer epilogue; captured after an eager call with such an
    out, it still replays fused (the replay workspace's device epoch counts it),
    and right. An out of an alignment no eager call had takes the plain path."""
    import overlap_kernels as ok
    from overlap_kernels.limits import REPLAY_EPOCH_SLOT
    from overlap_kernels.ops import paths, plans
    from overlap_kernels.ops.reduce_details import run as reduce_module
    from overlap_kernels.runtime.workspace import _WORKSPACES

    dist, device = setup_rank(rank, use_gpu)
    dtype = torch.bfloat16 if use_gpu else torch.float32
    x, w = (
        torch.randn(16, 64, dtype=dtype, device=device),
        torch.randn(64, 48, dtype=dtype, device=device),
    )
    config = {"path": "one_shot", "timeout_s": 20.0}
    store = torch.empty(16 * 48 + 1, dtype=dtype, device=device)
    out = store[1:].view(16, 48)  # 2 or 4 bytes past a 16-byte boundary
    check_sum(dist, ok.gemm_ar(x, w, config=config, out=out), x, w, what="eager, unaligned out")
    plan = plans.cached(plans.signature("gemm_ar", x, w, None, config, None))
    if not use_gpu:  # what CUDA's eager call prepares
        plan.fused.prepare_replay(x, w, torch.empty(16, 48, dtype=dtype), plan.cfg)
    replay_ws = _WORKSPACES[(dist.group.WORLD.group_name, f"{device}/replay")]
    epochs = int(replay_ws.chunk_flags[REPLAY_EPOCH_SLOT])
    if use_gpu:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ok.gemm_ar(x, w, config=config, out=out)
        replay = graph.replay
    else:
        reduce_module.capturing = lambda device: True

        def replay():
            ok.gemm_ar(x, w, config=config, out=out)

    for i in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        replay()
        check_sum(dist, out, x, w, what=f"replay {i}, unaligned out")
    replayed = int(replay_ws.chunk_flags[REPLAY_EPOCH_SLOT]) - epochs
    if not use_gpu:  # an alignment no eager call had: the plain pair (replay workspace untouched)
        other = torch.empty(16 * 48 + 2, dtype=dtype, device=device)[2:].view(16, 48)
        check_sum(dist, ok.gemm_ar(x, w, config=config, out=other), x, w, what="new alignment")
        assert int(replay_ws.chunk_flags[REPLAY_EPOCH_SLOT]) - epochs == replayed
        reduce_module.capturing = paths.capturing
    dist.barrier()
    ok.reset_workspaces()
    return replayed


def test_an_unaligned_out_replays_fused_cpu():
    assert run_ranks(unaligned_out_body, 2, False) == [3, 3]


@gpu_ranks(worlds=(2,), backends=("torch",))
def test_an_unaligned_out_replays_fused_gpu(world, gpus, backend):
    assert run_on_gpus(unaligned_out_body, world, gpus, backend) == [3] * world
