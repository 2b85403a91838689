"""MoE dispatch / combine and the fused MoE GEMM ops on 1-4 rank processes: CPU
(gloo, Triton's interpreter) and, behind the ``gpu`` marker, CUDA GPUs (NCCL).

What is tested is the MoE contract (issue 4) as written: routing, row order,
handle, numerics and errors. Every rank gathers everyone's inputs (CPU copies
through all_gather_object: T differs per rank), computes the contract's routing
itself (``expected_rows``) and an fp64 reference; dispatch must be bit-exact,
everything that sums is judged element by element against the error the
contract's roundings allow (``combine_bound``, ``gemm_bound`` and
``mlp_reference`` say why); outputs are poisoned with NaN where the API takes
``out=``. Spawning costs ~3 s and the interpreter is slow, so each test spawns
once per world size and runs many tiny, ragged cases inside.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from types import SimpleNamespace

import pytest
import torch
from ranks import CPU_SHARED_WORLDS, gpu_ranks, run_on_gpus, runs_here, runs_on_cpu, setup_rank
from torch.nn.functional import silu

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import _UNIT_ROUNDOFF, poisoned

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
DTYPES = (BF16, FP16, FP32)
_EPS32 = 2.0**-24  # fp32's unit roundoff: weights, products and sums in fp32
# Half the spacing of the subnormals: the absolute error of one rounding near
# zero, where the relative bound u * |value| does not hold (fp16: 2^-25).
_TINY = {BF16: 2.0**-134, FP16: 2.0**-25, FP32: 2.0**-150}
_SILU_SLOPE = 1.1  # max |silu'(x)| = 1.0998 (at x ~ 2.4): |silu(a) - silu(b)| <= 1.1 |a - b|
# silu(gate) * up evaluated in fp32: exp, add, divide, multiply, each at most
# 2 ulp (ex2.approx and div.full on GPUs are 2 ulp; correctly rounded is 1/2).
_FP32_EVAL = 16 * _EPS32


def _everyone(dist, *tensors) -> list[tuple]:
    """Every rank's ``tensors`` as CPU copies, in rank order (their shapes differ)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, tuple(t.detach().cpu() for t in tensors))
    return parts


def _meta(t: torch.Tensor, device=None) -> tuple:
    return tuple(t.shape), t.dtype, device or t.device


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Equal bytes, equal bits (-0.0 is not 0.0); new_empty: standard strides even for one row.
    return t.new_empty(t.shape).copy_(t).view(torch.uint8)


# ---- the contract's routing, computed from everyone's topk_ids ---------------


def expected_rows(ids_all, num_experts: int) -> list[torch.Tensor]:
    """Per owner rank, the pairs it receives as int64 rows (g, s, t, j) in the
    contract's order: local expert, then source rank, token, slot, ascending."""
    world = len(ids_all)
    pairs = []
    for s, ids in enumerate(ids_all):
        ids = ids.long()
        t, j = (ids != -1).nonzero(as_tuple=True)  # row-major: t, then j, ascending
        g = ids[t, j]
        pairs.append(torch.stack([g, torch.full_like(g, s), t, j], 1))
    pairs = torch.cat(pairs)
    pairs = pairs[torch.sort(pairs[:, 0], stable=True).indices]  # (s, t, j) order kept
    return [pairs[pairs[:, 0] // (num_experts // world) == r] for r in range(world)]


def _flat_index(parts, rows):
    """Row index into torch.cat(parts) of (s, t) = rows[:, 1], rows[:, 2]."""
    offsets = torch.tensor([0, *itertools.accumulate(p.shape[0] for p in parts)])
    return offsets[rows[:, 1]] + rows[:, 2]


def _x_rows(xs, rows) -> torch.Tensor:
    """The token rows x_s[t] of ``rows``: what the owner of ``rows`` must receive."""
    return torch.cat(xs)[_flat_index(xs, rows)]


def dispatch_problem(recv_x, handle, rows, xs, ws, rank, num_experts, device) -> str | None:
    """What is wrong with one rank's dispatch (None: nothing). All of it exact:
    recv_x copies of the token rows, bit for bit, in ``rows``' order; counts,
    sources, tokens and fp32 weights. ``recv_x`` None: the handle only."""
    e_local = num_experts // len(xs)
    counts = tuple(int((rows[:, 0] == rank * e_local + e).sum()) for e in range(e_local))
    got = handle.expert_counts
    if not isinstance(got, tuple) or got != counts or not all(type(c) is int for c in got):
        return f"expert_counts {got!r}, expected {counts}"
    if handle.num_tokens != xs[rank].shape[0]:
        return f"num_tokens {handle.num_tokens}, expected {xs[rank].shape[0]}"
    weights = torch.cat([w.float() for w in ws])[_flat_index(ws, rows), rows[:, 3]]
    expected = {"recv_src_rank": rows[:, 1], "recv_src_token": rows[:, 2], "recv_weights": weights}
    if recv_x is not None:
        expected["recv_x"] = _x_rows(xs, rows)
    for name, want in expected.items():
        have = recv_x if name == "recv_x" else getattr(handle, name)
        if _meta(have) != _meta(want, device):
            return f"{name} is {_meta(have)}, expected {_meta(want, device)}"
        if want.numel() == 0:
            continue
        wrong = (_bits(have.cpu()) != _bits(want)).reshape(len(want), -1).any(1).nonzero()
        if len(wrong):
            i = int(wrong[0, 0])
            g, s, t, j = rows[i].tolist()
            return f"{name}[{i}] wrong: row order? (pair: rank {s} token {t} slot {j} expert {g})"
    return None


# ---- fp64 references and the error the contract allows -------------------------


def _gamma(n: int) -> float:
    return n * _EPS32 / (1 - n * _EPS32)  # error of an n-term fp32 dot product, any order


def gemm_bound(ref, magnitude, depth: int, dtype) -> torch.Tensor:
    """A product accumulated in fp32 over ``depth`` terms, rounded once to ``dtype``:
    u |ref| + 2 gamma_depth (|a| @ |b|). gamma_n bounds any summation order
    (blocked, split, FMA); the 2 because tensor cores may truncate their fp32
    additions instead of rounding (Fasi et al., 2021). (1 + 2u): a rounding of
    an already inexact value; tiny: a rounding among the subnormals."""
    u = _UNIT_ROUNDOFF[dtype]
    return (u * ref.abs() + 2 * _gamma(depth) * magnitude) * (1 + 2 * u) + _TINY[dtype]


def combine_bound(ref, magnitude, carried, k: int, dtype) -> torch.Tensor:
    """The contract's per-element bound on a combined output, with M = sum_j |w_j| |y_j|:

        |out - ref| <= (u (|ref| + M) + (k + 2) 2^-24 M + C) (1 + 2u) + (k + 1) tiny

    - u |ref|: the home rank rounds its fp32 sum to the dtype once;
    - u M: each owner rounds its contribution to a token (the sum of its pairs)
      to y's dtype once to send it (or the fused op rounds each weighted pair
      once): at most u times the sum of that owner's |w_j y_j|;
    - (k + 2) 2^-24 M: fp32 work: a weight converted to fp32 (fp64 weights),
      a product rounded, and at most k - 1 additions per token in any grouping;
    - C = sum_j |w_j| err(y_j): what y carries in when it is computed rather
      than given (a GEMM's accumulation and rounding, the MLP's steps);
    - (1 + 2u): roundings of already rounded values; (k + 1) tiny: the up to
      k + 1 roundings (contributions, output) among the subnormals."""
    u = _UNIT_ROUNDOFF[dtype]
    bound = u * (ref.abs() + magnitude) + (k + 2) * _EPS32 * magnitude + carried
    return bound * (1 + 2 * u) + (k + 1) * _TINY[dtype]


def combine_reference(rows, ys, weights, home: int, num_tokens: int, yerrs=None):
    """fp64 (ref, M, C) of ``home``'s combine: ref[t] = sum_j w[t, j] y(pair),
    M = sum_j |w||y|, C = sum_j |w| yerr; ``ys[o]`` [R_o, N] fp64 in owner o's rows."""
    ref = torch.zeros(num_tokens, ys[0].shape[1], dtype=FP64)
    magnitude, carried, w64 = ref.clone(), ref.clone(), weights.double()
    for o, (r, y) in enumerate(zip(rows, ys)):
        mine = r[:, 1] == home
        t, w = r[mine, 2], w64[r[mine, 2], r[mine, 3]][:, None]
        ref.index_add_(0, t, w * y[mine])
        magnitude.index_add_(0, t, w.abs() * y[mine].abs())
        if yerrs is not None:
            carried.index_add_(0, t, w.abs() * yerrs[o][mine])
    return ref, magnitude, carried


def _per_expert(expert_of_row, a, w) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of a [R, K] times its local expert's w[e] [K, N]; and |a| @ |w[e]|."""
    prod = a.new_zeros(a.shape[0], w.shape[2])
    magnitude = prod.clone()
    for e in range(w.shape[0]):
        sel = expert_of_row == e
        prod[sel], magnitude[sel] = a[sel] @ w[e], a[sel].abs() @ w[e].abs()
    return prod, magnitude


def mlp_reference(a, expert_of_row, w_gate_up, w_down, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 y = (silu(a Wg) * (a Wu)) Wd per row, and the bound on what the
    contract's roundings do to it: gate and up rounded after fp32 accumulation
    (gemm_bound: eg, eu); silu moves by at most 1.1 eg, so silu(gate) * up by
    drift = 1.1 eg (|up| + eu) + |silu(g)| eu; act evaluated in fp32 and
    rounded (u + 16 2^-24 of its size); y = act Wd carries the act error
    (e_act @ |Wd|) plus its own accumulation and rounding (gemm_bound)."""
    u, f, depth = _UNIT_ROUNDOFF[dtype], w_down.shape[1], a.shape[1]
    gu, mgu = _per_expert(expert_of_row, a, w_gate_up)
    g, up = gu[:, :f], gu[:, f:]
    eg, eu = gemm_bound(g, mgu[:, :f], depth, dtype), gemm_bound(up, mgu[:, f:], depth, dtype)
    act = silu(g) * up
    drift = _SILU_SLOPE * eg * (up.abs() + eu) + silu(g).abs() * eu
    e_act = (drift + (u + _FP32_EVAL) * (act.abs() + drift)) * (1 + 2 * u) + _TINY[dtype]
    y, my = _per_expert(expert_of_row, act, w_down)
    carried, _ = _per_expert(expert_of_row, e_act, w_down.abs())
    return y, carried + gemm_bound(y, my + carried, f, dtype)


def _close(out, ref, bound, dtype, device, name: str) -> str | None:
    """Shape, dtype, device, no NaN, and |out - ref| <= bound element by element."""
    if _meta(out) != _meta(ref.to(dtype), device):
        return f"{name} is {_meta(out)}, expected {_meta(ref.to(dtype), device)}"
    out = out.detach().cpu().double()
    if out.isnan().any():
        return f"NaN in {name} (a row never written?)"
    excess = (out - ref).abs() - bound
    if excess.numel() and excess.max() > 0:
        row, col = divmod(int(excess.argmax()), ref.shape[1])
        got, want, allowed = out[row, col].item(), ref[row, col].item(), bound[row, col].item()
        return f"{name}[{row}, {col}] is {got:.6g}, reference {want:.6g}, bound {allowed:.3g}"
    return None


def combine_problem(out, ref, magnitude, carried, k, dtype, device, name="out") -> str | None:
    return _close(out, ref, combine_bound(ref, magnitude, carried, k, dtype), dtype, device, name)


# ---- inputs --------------------------------------------------------------------

# (routing, k, experts per rank at least, x dtype, T = 0 on "one" rank / "all")
CASES = [
    ("topk", 1, 2, BF16, None),
    ("topk", 2, 2, FP16, "one"),
    ("topk", 8, 2, FP32, None),  # k = 8 distinct: E >= 8
    ("skewed", 1, 2, BF16, None),  # every token of every rank to one expert
    ("skewed", 4, 1, FP16, None),  # ... in slot 0, others distinct
    ("one_rank", 3, 3, FP32, None),  # all of a token's experts on one rank: 1 row, 3 pairs
    ("sparse", 2, 3, BF16, "one"),  # only experts g % 3 == 0: empty experts, empty ranks
    ("holes", 5, 2, FP16, None),  # ~40% of slots -1, token 0 has no valid slot
    ("dup", 3, 2, FP32, "one"),  # the same expert twice in a row (even tokens)
    ("any", 7, 1, BF16, None),  # k > E on small worlds: duplicates and -1 at random
    ("any", 6, 2, FP16, "all"),  # no rank has a token
    ("topk", 4, 4, FP32, None),
]
GEMM_CASES = [CASES[i] for i in (1, 2, 4, 5, 7, 8)]
PATHS = ("fused", "unfused")


def runs_case_here(world: int, use_gpu: bool, c: int) -> bool:
    """Whether CASES[c] runs in this body (ranks.runs_here: on more than one CPU rank, its
    share of the cases). Its alternative is c's turn in CASES' cycle of dtypes, so that the
    cases each world takes hold every dtype."""
    return runs_here(world, use_gpu, c, c // len(DTYPES))


def _fit(kind: str, k: int, e_local: int, world: int) -> int:
    """The fewest experts per rank (>= e_local) from which ``kind`` can pick k distinct."""
    fits = {"one_rank": lambda e: e >= k, "sparse": lambda e: len(range(0, e * world, 3)) >= k}
    while not fits.get(kind, lambda e: kind == "any" or e * world >= k)(e_local):
        e_local += 1
    return e_local


def _ids(kind: str, t: int, k: int, num_experts: int, world: int, case: int) -> torch.Tensor:
    def pick(pool, n=k):  # n distinct experts of ``pool`` per token
        return pool[torch.rand(t, len(pool)).argsort(1)[:, :n]]

    e_local = num_experts // world
    if kind == "skewed":
        hot = (7 * case + 3) % num_experts  # the same on every rank
        others = torch.tensor([g for g in range(num_experts) if g != hot], dtype=torch.long)
        ids = torch.cat([torch.full((t, 1), hot), pick(others, k - 1)], 1)
    elif kind == "one_rank":
        ids = torch.randint(0, world, (t, 1)) * e_local + pick(torch.arange(e_local))
    elif kind == "sparse":
        ids = pick(torch.arange(0, num_experts, 3))
    elif kind == "any":
        ids = torch.randint(-1, num_experts, (t, k))
    else:
        ids = pick(torch.arange(num_experts))
    if kind == "holes":
        ids[torch.rand(t, k) < 0.4] = -1
        ids[:1] = -1
    if kind == "dup":
        ids[::2, 1] = ids[::2, 0]
    return ids


def _weight(e_local, k, n, dtype, device, transposed=False) -> torch.Tensor:
    """[E_local, K, N], values ~ 1 / sqrt(K); ``transposed``: a view of a stored [E_local, N, K]."""
    if transposed:
        return (torch.randn(e_local, n, k) / math.sqrt(k)).to(dtype).to(device).transpose(1, 2)
    return (torch.randn(e_local, k, n) / math.sqrt(k)).to(dtype).to(device)


def make_inputs(case, c: int, rank: int, world: int, device, use_gpu: bool) -> SimpleNamespace:
    """Case ``case`` (call number ``c``): this rank's tokens, routing, weights, expert weights."""
    kind, k, e_local, dtype, zero = case
    e_local = _fit(kind, k, e_local, world)
    h, n, h2, f, t_max = (512, 384, 256, 128, 200) if use_gpu else (40, 24, 32, 12, 24)
    empty = zero == "all" or (zero == "one" and rank == c % world)
    t = 0 if empty else int(torch.randint(1, t_max + 1, ()))
    x = torch.randn(t, h).to(dtype)
    x[:1, :1] = -0.0  # copied bit for bit, sign included
    ids = _ids(kind, t, k, e_local * world, world, c).to((torch.int64, torch.int32)[c % 2])
    w = (torch.rand(t, k) + 0.05) if c % 2 == 0 else torch.randn(t, k)  # signed: cancellation
    ydtype = dtype if c % 2 else DTYPES[(DTYPES.index(dtype) + 1) % 3]  # combine's y dtype
    return SimpleNamespace(
        kind=kind, k=k, e_local=e_local, num_experts=e_local * world, dtype=dtype, ydtype=ydtype, t_max=t_max,
        x=x.to(device), ids=ids.to(device), w=w.to((FP32, BF16, FP64)[c % 3]).to(device),
        wf=_weight(e_local, h, n, ydtype, device),
        w1=_weight(e_local, h, n, dtype, device, transposed=c % 2 == 1),
        w2=_weight(e_local, n, h2, dtype, device, transposed=c % 3 == 1),
        wgu=_weight(e_local, h, 2 * f, dtype, device), wd=_weight(e_local, f, h, dtype, device),
    )  # fmt: skip


# ---- one call of an op, and its check ----------------------------------------


def run_case(ok, group, op: str, inp, config) -> dict:
    """``op``: "combine" (dispatch, the round trip into a poisoned out, then an
    expert function of width N != H combined), "gemm" (moe_dispatch_gemm, then
    moe_gemm_combine of its h), "mlp" or "mlp_graph" (moe_mlp in the graph mode:
    max_tokens_per_rank, every rank's largest T)."""
    x, ids, w, kw = inp.x, inp.ids, inp.w, {"num_experts": inp.num_experts, "config": config}
    if op == "combine":
        recv_x, handle = ok.moe_dispatch(x, ids, w, group, **kw)
        out = poisoned(tuple(x.shape), x.dtype, x.device)
        back = ok.moe_combine(recv_x, handle, out=out)
        assert back is out, "moe_combine did not return out"
        ends = itertools.pairwise([0, *itertools.accumulate(handle.expert_counts)])
        y = torch.cat([recv_x[a:b].float() @ inp.wf[e].float() for e, (a, b) in enumerate(ends)])
        y = y.to(inp.ydtype)
        return {"recv_x": recv_x, "handle": handle, "back": back, "y": y, "out": ok.moe_combine(y, handle)}  # fmt: skip
    if op == "gemm":
        h, handle = ok.moe_dispatch_gemm(x, ids, w, inp.w1, group, **kw)
        return {"h": h, "handle": handle, "out": ok.moe_gemm_combine(h, inp.w2, handle, config=config)}  # fmt: skip
    if op == "mlp_graph":
        kw["max_tokens_per_rank"] = inp.t_max
    return {"out": ok.moe_mlp(x, ids, w, inp.wgu, inp.wd, group, **kw)}


def check_case(dist, op: str, inp, outs: dict, what: str) -> None:
    """Collective: every rank judges its outputs of ``run_case`` against fp64."""
    rank, device, t, k, dtype = dist.get_rank(), inp.x.device, inp.x.shape[0], inp.k, inp.dtype
    what = f"{what}: {op} {inp.kind} k={k} E={inp.num_experts} {dtype} ids {inp.ids.dtype} w {inp.w.dtype} T={t}"  # fmt: skip
    mine = {"combine": ("y",), "gemm": ("h",), "mlp": (), "mlp_graph": ()}[op]
    got = _everyone(dist, *(getattr(inp, n) for n in ("x", "ids", "w", "w1", "w2", "wgu", "wd")),
                    *map(outs.get, mine))  # fmt: skip
    xs, idss, ws, w1s, w2s, wgus, wds, *ys_given = (list(c) for c in zip(*got))
    rows = expected_rows(idss, inp.num_experts)
    experts = [r[:, 0] - o * inp.e_local for o, r in enumerate(rows)]  # local expert of each row
    a = [_x_rows(xs, r).double() for r in rows]
    me = (rows[rank], xs, ws, rank, inp.num_experts, device)

    def judge(problem):
        assert problem is None, f"{what}: {problem}"

    if op == "combine":
        judge(dispatch_problem(outs["recv_x"], outs["handle"], *me))
        ref, m, _ = combine_reference(rows, a, ws[rank], rank, t)
        judge(combine_problem(outs["back"], ref, m, 0.0, k, dtype, device, "round trip"))
        ref, m, _ = combine_reference(rows, [y.double() for y in ys_given[0]], ws[rank], rank, t)
        judge(combine_problem(outs["out"], ref, m, 0.0, k, inp.ydtype, device, "combined y"))
        return
    if op == "gemm":
        judge(dispatch_problem(None, outs["handle"], *me))
        ref, m = _per_expert(experts[rank], a[rank], w1s[rank].double())
        judge(_close(outs["h"], ref, gemm_bound(ref, m, a[rank].shape[1], dtype), dtype, device, "h"))  # fmt: skip
        n = w2s[0].shape[1]
        products = [_per_expert(e, h.double(), w2.double()) for e, h, w2 in zip(experts, ys_given[0], w2s)]  # fmt: skip
        ys, yerrs = [p for p, _ in products], [gemm_bound(p, m, n, dtype) for p, m in products]
    else:
        chains = [mlp_reference(*args, dtype) for args in zip(a, experts, map(torch.Tensor.double, wgus), map(torch.Tensor.double, wds))]  # fmt: skip
        ys, yerrs = [y for y, _ in chains], [e for _, e in chains]
    ref, m, carried = combine_reference(rows, ys, ws[rank], rank, t, yerrs)
    judge(combine_problem(outs["out"], ref, m, carried, k, dtype, device))


def _run_checked(ok, dist, op, inp, config, what):
    check_case(dist, op, inp, run_case(ok, dist.group.WORLD, op, inp, config), f"{what} {config}")


# ---- the oracle can fail ---------------------------------------------------------


def _emulate_combine(rows, ys, weights, home, num_tokens, dtype):
    """The contract's combine numerics done plainly: each owner's weighted pairs
    of a token summed in fp32, rounded to dtype; home sums those in fp32, rounds."""
    out = torch.zeros(num_tokens, ys[0].shape[1])
    for r, y in zip(rows, ys):
        t, j = r[r[:, 1] == home, 2], r[r[:, 1] == home, 3]
        part = torch.zeros_like(out).index_add_(0, t, weights.float()[t, j][:, None] * y[r[:, 1] == home].float())  # fmt: skip
        out += part.to(dtype).float()
    return out.to(dtype)


def _emulate_mlp(a, expert_of_row, w_gate_up, w_down, dtype, act_fn=silu):
    f = w_down.shape[1]
    gu = _per_expert(expert_of_row, a.float(), w_gate_up.float())[0]
    act = (act_fn(gu[:, :f].to(dtype).float()) * gu[:, f:].to(dtype).float()).to(dtype)
    return _per_expert(expert_of_row, act.float(), w_down.float())[0].to(dtype)


def test_unfused_gemm_takes_cublas_per_expert_where_a_rank_holds_few_experts(monkeypatch):
    """Where torch._grouped_mm would run (made to fit here), a rank of at most
    cublas_max_local_experts experts runs one torch.mm per expert, empty experts
    included, within fp32's dot-product bound (gamma_K = K u / (1 - K u) of |a| @ |b|)
    of float64; more experts, or the default 0, take torch._grouped_mm by the cumulative
    row ends; a negative bound is refused."""
    import overlap_kernels as ok
    from overlap_kernels.ops.moe import MoeConfig
    from overlap_kernels.ops.moe_details import steps

    grouped = []

    def fake_grouped_mm(a, b, offs):
        grouped.append(offs.tolist())
        return torch.zeros(a.shape[0], b.shape[2], dtype=a.dtype)

    monkeypatch.setattr(steps, "torch_grouped_mm_fits", lambda a, b: True)
    monkeypatch.setattr(torch, "_grouped_mm", fake_grouped_mm)
    counts, k = (5, 0, 7), 8
    a = torch.randn(12, k)
    expert = torch.tensor([0] * 5 + [2] * 7)
    # [E, K, N] weights, and [E, N, K] ones passed transposed (nn.Linear's layout)
    for b in (torch.randn(3, k, 6), torch.randn(3, 6, k).transpose(1, 2)):
        out = steps.grouped_gemm(a, b, counts, MoeConfig(cublas_max_local_experts=3))
        exact = torch.einsum("rk,rkn->rn", a.double(), b.double()[expert])
        gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
        bound = gamma * torch.einsum("rk,rkn->rn", a.double().abs(), b.double().abs()[expert])
        assert grouped == [] and ((out.double() - exact).abs() <= bound).all()
    for cfg in (MoeConfig(cublas_max_local_experts=2), MoeConfig()):
        steps.grouped_gemm(a, b, counts, cfg)
    assert grouped == [[5, 5, 12]] * 2
    with pytest.raises(ok.OverlapInputError, match="cublas_max_local_experts must be >= 0"):
        MoeConfig(cublas_max_local_experts=-1).validate()


def test_grouped_tiles_sweep_n_once_per_group_of_row_blocks():
    """group_m row blocks of an expert share each column block's turn; no group spans
    two experts; the same tiles in every order; a stable sort by arrival keeps it."""
    from overlap_kernels.ops.moe_details.layout import grouped_tiles

    # expert 0: 40 rows = row blocks [0,16) [16,32) [32,40); expert 1: [40,56) [56,60)
    tiles = grouped_tiles([40, 20], 16, 16, 40, group_m=2)[:, :4]
    rows_cols = [(int(t[1]), int(t[3])) for t in tiles]
    assert rows_cols == [(0, 0), (16, 0), (0, 16), (16, 16), (0, 32), (16, 32),  # a group of two
                         (32, 0), (32, 16), (32, 32),  # expert 0's last row block alone
                         (40, 0), (56, 0), (40, 16), (56, 16), (40, 32), (56, 32)]  # fmt: skip
    assert (tiles[:, 0] == [0] * 9 + [1] * 6).all() and (
        tiles[:9, 2] == [16, 32] * 3 + [40] * 3
    ).all()
    plain = grouped_tiles([40, 20], 16, 16, 40)
    assert [(int(t[1]), int(t[3])) for t in plain][:4] == [(0, 0), (0, 16), (0, 32), (16, 0)]
    assert sorted(map(tuple, plain.tolist())) == sorted(
        map(tuple, grouped_tiles([40, 20], 16, 16, 40, group_m=2).tolist())
    )
    # Rows of sources 0, 1 (expert 0) and 1 (expert 1); source 1 arrives first.
    sources = torch.tensor([0] * 20 + [1] * 20 + [1] * 20).numpy()
    ordered = grouped_tiles([40, 20], 16, 16, 40, group_m=2, sources=sources, arrival=[1, 0])
    first = [(int(t[1]), int(t[3])) for t in ordered[:9]]
    assert first == [
        (32, 0),
        (32, 16),
        (32, 32),
        (40, 0),
        (56, 0),
        (40, 16),
        (56, 16),
        (40, 32),
        (56, 32),
    ]


def test_oracle_rejects_wrong_results():
    """The oracle can fail: a wrong row order, one wrong bit or element, a
    missing pair, a skipped weight, an unwritten row, a skipped silu; and it
    accepts what the contract's numerics produce, in every dtype."""
    torch.manual_seed(int(time.time_ns() % 2**31))
    cpu, world, e_local, k, h, f = torch.device("cpu"), 3, 2, 3, 16, 8
    for dtype in DTYPES:
        ts = (9, 0, 6)
        xs = [torch.randn(t, h).to(dtype) for t in ts]
        idss = [torch.randint(-1, world * e_local, (t, k)) for t in ts]
        # duplicates, two experts on one rank, holes
        idss[0][:4] = torch.tensor([[1, 1, -1], [0, 1, 5], [0, 2, 3], [1, 0, 4]])
        ws = [torch.rand(t, k) + 0.5 for t in ts]
        ws[0][1, 0] = 0.25  # far from 1: a combine that skips it (uses 1) is off by 3x
        rows = expected_rows(idss, world * e_local)
        r = rows[0]  # rank 0 receives >= 6 pairs from tokens 0-3 of rank 0 alone

        def handle(r, counts, ws=ws):
            weights = torch.cat(ws)[_flat_index(ws, r), r[:, 3]]
            return SimpleNamespace(expert_counts=counts, recv_src_rank=r[:, 1],
                                   recv_src_token=r[:, 2], recv_weights=weights, num_tokens=9)  # fmt: skip

        def problem(recv_x, handle, r=r, xs=xs, ws=ws):
            return dispatch_problem(recv_x, handle, r, xs, ws, 0, world * e_local, cpu)

        counts = tuple(int((r[:, 0] == e).sum()) for e in range(e_local))
        assert problem(_x_rows(xs, r), handle(r, counts)) is None
        # Two pairs of one expert, different tokens, swapped (consistently, everywhere).
        b = int(((r[:, 1:3] != r[0, 1:3]).any(1) & (r[:, 0] == r[0, 0])).nonzero()[0, 0])
        swapped = r[[b, *range(1, b), 0, *range(b + 1, len(r))]]
        assert "row order" in problem(_x_rows(xs, swapped), handle(swapped, counts))
        assert "recv_x[0] " in problem(_x_rows(xs, swapped), handle(r, counts))
        flipped = _x_rows(xs, r)
        flipped.view({2: torch.int16, 4: torch.int32}[flipped.element_size()])[3, 5] ^= 1
        assert "recv_x[3] " in problem(flipped, handle(r, counts))
        missing = handle(r[1:], (counts[0] - 1, counts[1]))
        assert "expert_counts" in problem(_x_rows(xs, r[1:]), missing)

        # Combine on home rank 0: of the round trip, then of computed MLP outputs.
        def judged(out, ref, m, carried, dtype=dtype):  # passes; 4x its bound off or NaN: fails
            assert combine_problem(out, ref, m, carried, k, dtype, cpu) is None
            wrong = out.clone()
            wrong[2, 7] = (ref[2, 7] + 4 * combine_bound(ref, m, carried, k, dtype)[2, 7]).to(dtype)
            assert "out[2, 7]" in combine_problem(wrong, ref, m, carried, k, dtype, cpu)
            wrong[5:] = float("nan")
            assert "NaN" in combine_problem(wrong, ref, m, carried, k, dtype, cpu)

        x_rows = [_x_rows(xs, q) for q in rows]
        ref, m, _ = combine_reference(rows, [q.double() for q in x_rows], ws[0], 0, 9)
        judged(_emulate_combine(rows, x_rows, ws[0], 0, 9, dtype), ref, m, 0.0)
        dropped = [q[1:] if o == 0 else q for o, q in enumerate(rows)]  # rank 0's first pair
        lost = _emulate_combine(dropped, [_x_rows(xs, q) for q in dropped], ws[0], 0, 9, dtype)
        assert combine_problem(lost, ref, m, 0.0, k, dtype, cpu) is not None
        unweighted = ws[0].clone()
        unweighted[1, 0] = 1.0
        skipped = _emulate_combine(rows, x_rows, unweighted, 0, 9, dtype)
        assert "out[1, " in combine_problem(skipped, ref, m, 0.0, k, dtype, cpu)
        experts = [q[:, 0] - o * e_local for o, q in enumerate(rows)]
        wgu, wd = _weight(e_local, h, 2 * f, dtype, cpu), _weight(e_local, f, h, dtype, cpu)
        chains = [mlp_reference(q.double(), e, wgu.double(), wd.double(), dtype) for q, e in zip(x_rows, experts)]  # fmt: skip
        ys, yerrs = [y for y, _ in chains], [e for _, e in chains]
        ref, m, carried = combine_reference(rows, ys, ws[0], 0, 9, yerrs)
        for act_fn in (silu, lambda g: g):  # the second forgets the silu
            ys = [_emulate_mlp(q, e, wgu, wd, dtype, act_fn) for q, e in zip(x_rows, experts)]
            out = _emulate_combine(rows, ys, ws[0], 0, 9, dtype)
            if act_fn is silu:
                judged(out, ref, m, carried)
            else:
                assert combine_problem(out, ref, m, carried, k, dtype, cpu) is not None


# ---- correctness ------------------------------------------------------------------


def dispatch_combine_body(rank, world, use_gpu):
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    checked = 0
    for c, case in enumerate(CASES):
        if not runs_case_here(world, use_gpu, c):
            continue
        # A dict, a MoeConfig or nothing; a lost signal fails in 20 s.
        config = (None, {"timeout_s": 20.0}, ok.MoeConfig(timeout_s=20.0))[c % 3]
        _run_checked(ok, dist, "combine", make_inputs(case, c, rank, world, device, use_gpu), config, f"case {c}")  # fmt: skip
        checked += 1
    return checked


@pytest.mark.parametrize("world", [1, *CPU_SHARED_WORLDS])  # (GPUs: 4 too)
def test_dispatch_and_combine_cpu(world):
    cases = sum(runs_case_here(world, False, c) for c in range(len(CASES)))
    assert run_ranks(dispatch_combine_body, world, False) == [cases] * world


def gemm_body(rank, world, use_gpu):
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    calls = 0
    for c, case in enumerate(GEMM_CASES):  # w1 and w2 in both layouts over the cases
        for p, path in enumerate(PATHS):
            if not runs_here(world, use_gpu, c, p):
                continue
            inp = make_inputs(case, c, rank, world, device, use_gpu)
            config = {"path": path, "timeout_s": 20.0}
            # The grouped GEMM's tiles in groups of row blocks, whole ones stored by TMA (the
            # fp16 cases: beside fp32 tiles the TMA epilogue's output tile does not fit on GPUs).
            if case[3] == FP16:
                config.update(group_m=2, epilogue="tma")
            for op in ("gemm", "mlp"):
                _run_checked(ok, dist, op, inp, ok.MoeConfig(**config) if c % 2 else config, f"case {c}")  # fmt: skip
                calls += 1
    return calls


@pytest.mark.parametrize("world", [1, *CPU_SHARED_WORLDS])
def test_gemm_ops_and_mlp_cpu(world):
    runs = runs_on_cpu(world, len(GEMM_CASES), len(PATHS))
    assert run_ranks(gemm_body, world, False) == [2 * runs] * world  # (gemm and mlp per run)


# The GEMM cases and a bf16 one (sparse experts, an empty rank): on sm_90 bf16 takes
# torch._grouped_mm by the device's expert ends, the other dtypes the library's grouped GEMM.
GRAPH_CASES = [*GEMM_CASES, CASES[6]]


def graph_mlp_body(rank, world, use_gpu):
    """moe_mlp with max_tokens_per_rank (the graph mode) against fp64; a path other
    than "auto", or max_recv_tokens, beside it is refused before anything is sent."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    calls = 0
    for c, case in enumerate(GRAPH_CASES):
        if runs_here(world, use_gpu, c, 0):
            inp = make_inputs(case, c, rank, world, device, use_gpu)
            _run_checked(ok, dist, "mlp_graph", inp, {"timeout_s": 20.0}, f"case {c}")
            calls += 1
    for config, refused in (({"path": "unfused"}, "config path 'unfused' is not taken"),
                            ({"max_recv_tokens": 64}, "config max_recv_tokens bounds")):  # fmt: skip
        with pytest.raises(ok.OverlapInputError, match=f"moe_mlp: {refused}"):
            ok.moe_mlp(inp.x, inp.ids, inp.w, inp.wgu, inp.wd, num_experts=inp.num_experts,
                       config=config, max_tokens_per_rank=inp.t_max)  # fmt: skip
    return calls


@pytest.mark.parametrize("world", [1, *CPU_SHARED_WORLDS])
def test_mlp_in_graph_mode_cpu(world):
    runs = runs_on_cpu(world, len(GRAPH_CASES), 1)
    assert run_ranks(graph_mlp_body, world, False) == [runs] * world


@gpu_ranks()
def test_mlp_in_graph_mode_gpu(world, gpus, backend):
    assert run_on_gpus(graph_mlp_body, world, gpus, backend) == [len(GRAPH_CASES)] * world


# ---- a late rank, and calls back to back ---------------------------------------

_CYCLE = [("combine", None), ("mlp", "fused"), ("gemm", "fused"), ("mlp", "unfused"), ("gemm", "unfused")]  # fmt: skip


def _config(path):  # "path" only for the GEMM ops and moe_mlp
    return {"timeout_s": 20.0, **({"path": path} if path else {})}


def delayed_and_back_to_back_body(rank, world, use_gpu):
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    # 1. One rank enters each op 1 s after its peers.
    for i, (op, path) in enumerate(_CYCLE):
        inp = make_inputs(CASES[i], i, rank, world, device, use_gpu)
        if rank == (world - 1 - i) % world:
            time.sleep(1.0)
        _run_checked(ok, dist, op, inp, _config(path), "late rank")
    # 2. 20 calls back to back, T, routing, dtype and op changing every call,
    # rank 1 late by 0.2 s before every third; checked only after the last (no
    # collective in between lines the ranks up).
    done = []
    for i in range(20):
        op, path = _CYCLE[i % len(_CYCLE)]
        inp = make_inputs(CASES[(7 * i) % len(CASES)], i, rank, world, device, use_gpu)
        if rank == 1 and i % 3 == 0:
            time.sleep(0.2)
        outs = run_case(ok, dist.group.WORLD, op, inp, _config(path))
        done.append((op, inp, outs, f"call {i} {_config(path)}"))
    ok.raise_if_failed()
    for op, inp, outs, what in done:
        check_case(dist, op, inp, outs, what)
    return len(done)


# Three ranks (a delayed rank among two peers); two are the GPU variant's.
@pytest.mark.parametrize("world", [3])
def test_delayed_rank_and_20_calls_cpu(world):
    assert run_ranks(delayed_and_back_to_back_body, world, False) == [20] * world


# ---- capacity, out-of-range experts, bad inputs --------------------------------


def errors_body(rank, world, use_gpu):
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    group = dist.group.WORLD
    assert issubclass(ok.MoeCapacityError, ValueError)
    # 1. Every token of every rank to two experts of the last rank: 2 * total
    # pairs but `total` token rows (counted once per (source, token)).
    hot, total, t = world - 1, sum(3 + r for r in range(world)), 3 + rank
    inp = make_inputs(("topk", 2, 2, BF16, None), 0, rank, world, device, use_gpu)
    inp.x = torch.randn(t, inp.x.shape[1]).to(BF16).to(device)
    inp.w = torch.rand(t, 2, device=device) + 0.1
    inp.ids = torch.tensor([[2 * hot + 1, 2 * hot]] * t, device=device)
    for op in ("combine", "mlp"):
        config = {"max_recv_tokens": total, **({"path": "fused"} if op == "mlp" else {})}
        _run_checked(ok, dist, op, inp, config, "exactly max_recv_tokens rows")
        with pytest.raises(ok.MoeCapacityError, match=rf"\brank {hot}\b") as e:
            run_case(ok, group, op, inp, {**config, "max_recv_tokens": total - 1})
        assert re.search(rf"\b{total}\b", str(e.value)), f"the count {total} not named: {e.value}"
        _run_checked(ok, dist, op, inp, None, "after MoeCapacityError")
    # 2. An expert out of range on one rank: ValueError on every rank, naming it.
    for i, (bad, value, op) in enumerate([(hot, 4 * world, "combine"), (0, -2, "gemm"), (world // 2, 99, "mlp")]):  # fmt: skip
        inp = make_inputs(("topk", 3, 2, FP16, None), i, rank, world, device, use_gpu)
        good_ids = inp.ids.clone()
        if rank == bad:
            inp.ids[inp.ids.shape[0] // 2, 1] = value
        with pytest.raises(ValueError, match=rf"\brank {bad}\b") as e:
            run_case(ok, group, op, inp, None)
        assert not isinstance(e.value, ok.MoeCapacityError), e.value
        inp.ids = good_ids
        _run_checked(ok, dist, op, inp, None, f"after topk_ids = {value} on rank {bad}")
    # 3. Bad inputs, rejected on the calling rank before anything launches.
    inp = make_inputs(("topk", 2, 2, FP32, None), 1, rank, world, device, use_gpu)
    x, ids, w, num_experts, e_local = inp.x, inp.ids, inp.w, inp.num_experts, inp.e_local
    _, handle = ok.moe_dispatch(x, ids, w, group, num_experts=num_experts)
    h, _ = ok.moe_dispatch_gemm(x, ids, w, inp.w1, group, num_experts=num_experts)
    y = torch.randn(sum(handle.expert_counts) + 1, 8, device=device)
    elsewhere = torch.device("meta") if device.type == "cpu" else torch.device("cpu")
    hh, n, f = x.shape[1], inp.w1.shape[2], inp.wd.shape[1]

    def dispatch(x=x, ids=ids, w=w, num_experts=num_experts):
        return ok.moe_dispatch(x, ids, w, group, num_experts=num_experts)

    def dispatch_gemm(w1):
        return ok.moe_dispatch_gemm(x, ids, w, w1, group, num_experts=num_experts)

    def mlp(wgu=inp.wgu, wd=inp.wd):
        return ok.moe_mlp(x, ids, w, wgu, wd, group, num_experts=num_experts)

    cases = [
        (lambda: dispatch(x=x[None]), "x"),
        (lambda: dispatch(x=x.int()), "x"),
        (lambda: dispatch(x=x.double()), "x"),
        (lambda: dispatch(ids=ids.float()), "topk_ids"),
        (lambda: dispatch(ids=ids[:, 0]), "topk_ids"),
        (lambda: dispatch(w=w.int()), "topk_weights"),
        (lambda: dispatch(w=w[:, :1]), "topk_weights"),
        (lambda: dispatch(ids=ids[1:], w=w[1:]), "topk_ids"),
        (lambda: dispatch(ids=ids.to(elsewhere)), "topk_ids"),
        (lambda: dispatch(w=w.to(elsewhere)), "topk_weights"),
        (lambda: dispatch(num_experts=0), "num_experts"),
        (lambda: dispatch(num_experts=num_experts + 1 if world > 1 else -2), "num_experts"),
        (lambda: dispatch_gemm(_weight(e_local + 1, hh, n, FP32, device)), "w1"),
        (lambda: dispatch_gemm(_weight(e_local, hh + 1, n, FP32, device)), "w1"),
        (lambda: dispatch_gemm(inp.w1.to(elsewhere)), "w1"),
        (lambda: ok.moe_gemm_combine(h, _weight(e_local, n + 1, 8, FP32, device), handle), "w2"),
        (lambda: ok.moe_gemm_combine(h, _weight(e_local + 1, n, 8, FP32, device), handle), "w2"),
        (lambda: mlp(wgu=_weight(e_local, hh + 1, 2 * f, FP32, device)), "w_gate_up"),
        (lambda: mlp(wgu=_weight(e_local + 1, hh, 2 * f, FP32, device)), "w_gate_up"),
        (lambda: mlp(wd=_weight(e_local, f + 1, hh, FP32, device)), "w_down"),
        (lambda: mlp(wd=_weight(e_local, f, hh + 1, FP32, device)), "w_down"),
        (lambda: ok.moe_combine(y, handle), "y"),
    ]
    for i, (call, name) in enumerate(cases):
        with pytest.raises((ValueError, TypeError), match=rf"\b{name}\b"):
            call()
            pytest.fail(f"bad input {i} ({name}) was accepted")
    # Nothing launched: the next calls are right.
    for op in ("combine", "gemm", "mlp"):
        _run_checked(ok, dist, op, inp, None, "after bad inputs")
    return len(cases)


@pytest.mark.parametrize("world", [1, 3])
def test_capacity_out_of_range_and_bad_inputs_cpu(world):
    assert run_ranks(errors_body, world, False) == [22] * world


# ---- operands that require grad ---------------------------------------------------


def grad_refused_body(rank, world, use_gpu):
    """Each op refuses every operand that requires grad (grad mode on), naming
    the differentiable way, before a plan, an agreement or a workspace epoch:
    the epoch and the plans made stay as they were, and the next calls on
    every rank are right (also under no_grad, with operands that require grad)."""
    import overlap_kernels as ok
    from overlap_kernels.ops import plans

    dist, device = setup_rank(rank, use_gpu)
    group = dist.group.WORLD
    inp = make_inputs(("topk", 2, 2, FP32, None), 1, rank, world, device, use_gpu)
    x, ids, w, kw = inp.x, inp.ids, inp.w, {"num_experts": inp.num_experts}
    recv_x, handle = ok.moe_dispatch(x, ids, w, group, **kw)
    h, gemm_handle = ok.moe_dispatch_gemm(x, ids, w, inp.w1, group, **kw)
    ws = handle._route.ws
    epoch, made = ws.epoch, dict(plans.made)
    chain = "functional.moe_dispatch, your experts, then overlap_kernels.integrations.functional.moe_combine"
    calls = [
        ("moe_dispatch", lambda x, w: ok.moe_dispatch(x, ids, w, group, **kw), (x, w),
         "torch.ops.overlap_kernels.moe_dispatch"),
        ("moe_dispatch_gemm", lambda x, w, w1: ok.moe_dispatch_gemm(x, ids, w, w1, group, **kw),
         (x, w, inp.w1), chain),
        ("moe_mlp", lambda x, w, wgu, wd: ok.moe_mlp(x, ids, w, wgu, wd, group, **kw),
         (x, w, inp.wgu, inp.wd), chain),
        ("moe_combine", lambda y: ok.moe_combine(y, handle), (recv_x,),
         "functional.moe_combine (with functional.moe_dispatch's handle)"),
        ("moe_gemm_combine", lambda h, w2: ok.moe_gemm_combine(h, w2, gemm_handle), (h, inp.w2), chain),
    ]  # fmt: skip
    refused = 0
    for op, call, operands, alternative in calls:
        for i in range(len(operands)):
            leaves = [t.detach().clone().requires_grad_(j == i) for j, t in enumerate(operands)]
            with pytest.raises(
                ok.OverlapInputError,
                match=rf"^{op}: an operand requires grad.*{re.escape(alternative)}",
            ):
                call(*leaves)
            refused += 1
    assert ws.epoch == epoch, f"a refused call advanced the workspace epoch {epoch} -> {ws.epoch}"
    assert dict(plans.made) == made, "a refused call made a plan (and met its peers)"
    for op in ("combine", "gemm", "mlp"):
        _run_checked(ok, dist, op, inp, None, "after refused calls")
    with torch.no_grad():  # nothing is recorded: allowed
        for name in ("x", "w", "w1", "w2", "wgu", "wd"):
            setattr(inp, name, getattr(inp, name).detach().clone().requires_grad_())
        for op in ("combine", "gemm", "mlp"):
            _run_checked(ok, dist, op, inp, None, "under no_grad")
    return refused


@pytest.mark.parametrize("world", [1, 2])
def test_operands_that_require_grad_are_refused_before_anything_moves_cpu(world):
    assert run_ranks(grad_refused_body, world, False) == [12] * world


# ---- a rank that never calls ----------------------------------------------------


def timeout_body(rank, world, use_gpu):
    """Rank 1 skips one call of moe_dispatch, then of moe_combine (after both
    dispatched: the handle carries timeout_s), then of moe_mlp: rank 0 raises
    within the 3 s deadline, naming op, rank and peer; reset_workspaces then
    restores a working state."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    group, config = dist.group.WORLD, {"timeout_s": 3.0}
    elapsed = []
    for op in ("moe_dispatch", "moe_combine", "moe_mlp"):
        inp = make_inputs(("topk", 2, 2, FP32, None), 1, rank, world, device, use_gpu)
        _run_checked(ok, dist, "combine", inp, config, f"before {op}")
        x, ids, w, kw = inp.x, inp.ids, inp.w, {"num_experts": inp.num_experts, "config": config}
        if op == "moe_combine":  # every rank dispatches; rank 1 then skips the combine
            recv_x, handle = ok.moe_dispatch(x, ids, w, group, **kw)
        if rank == 0:
            start = time.monotonic()
            with pytest.raises(ok.OverlapTimeoutError, match=rf"^{op}: rank 0 waited more than 3 s for rank 1 "):  # fmt: skip
                if op == "moe_dispatch":
                    ok.moe_dispatch(x, ids, w, group, **kw)
                elif op == "moe_combine":
                    ok.moe_combine(recv_x, handle)
                else:
                    ok.moe_mlp(x, ids, w, inp.wgu, inp.wd, group, **{**kw, "config": {**config, "path": "fused"}})  # fmt: skip
                ok.raise_if_failed()  # on GPUs the error may be read after the kernels ran
            elapsed.append(time.monotonic() - start)
        dist.barrier()  # rank 1 stays alive while rank 0 waits in vain
        ok.reset_workspaces()
    inp = make_inputs(("holes", 3, 2, BF16, None), 2, rank, world, device, use_gpu)
    _run_checked(ok, dist, "mlp", inp, {"path": "fused"}, "after reset_workspaces")
    return elapsed


def test_peer_that_never_calls_raises_timeout_cpu():
    elapsed, silent = run_ranks(timeout_body, 2, False)
    assert silent == [] and len(elapsed) == 3
    # The 3 s deadline, not a hang.
    assert all(t < 10 for t in elapsed), elapsed


# ---- GPUs ---------------------------------------------------------------------


@gpu_ranks()
def test_dispatch_and_combine_gpu(world, gpus, backend):
    assert run_on_gpus(dispatch_combine_body, world, gpus, backend) == [len(CASES)] * world


@gpu_ranks()
def test_gemm_ops_and_mlp_gpu(world, gpus, backend):
    assert run_on_gpus(gemm_body, world, gpus, backend) == [4 * len(GEMM_CASES)] * world


@gpu_ranks(worlds=(2,))
def test_delayed_rank_and_20_calls_gpu(world, gpus, backend):
    assert run_on_gpus(delayed_and_back_to_back_body, world, gpus, backend) == [20] * 2


@gpu_ranks(worlds=(2,))
def test_capacity_out_of_range_and_bad_inputs_gpu(world, gpus, backend):
    assert run_on_gpus(errors_body, world, gpus, backend) == [22] * 2


@gpu_ranks(worlds=(2,))
def test_timeout_gpu(world, gpus, backend):
    elapsed, _ = run_on_gpus(timeout_body, world, gpus, backend)
    assert all(t < 10 for t in elapsed), elapsed
