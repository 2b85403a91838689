"""Oracles for the tests and the CPU demo: fp64 references and tolerances that mean something.

A low-precision result is judged against the fp64 product of the same inputs,
twice:

- as a whole: its relative error may be at most twice the error the plain
  product makes in the same dtype (``2 * |plain - fp64|``, as in quack's tests)
  plus a floor where both are rounding-level. That is what "as accurate as the
  plain path" means, and a missing chunk or a wrong row is O(1), not O(eps).
- element by element, so that a few wrong elements cannot hide in the norm:
  ``|out - ref| <= 2 * (u * |ref| + K * 2**-24 * (|a| @ |b|))``: rounding the
  output to the dtype (unit roundoff u) plus the standard bound on summing K
  fp32 products (gamma_K ~ K * 2**-24 times the sum of magnitudes), with a
  factor 2 for a different but equally valid summation order.

A reduced product (gemm_rs, gemm_ar: the sum over ranks of x_r @ w_r) is
judged the same way against the algorithm every such op runs, NCCL after
cuBLAS included: each rank's partial rounded to the dtype (that is how it
travels), the partials summed, the sum rounded. Its "plain" error is that
algorithm's error with an exact sum, and the per-element bound adds the
rounding of every partial (u * sum_r |x_r @ w_r|).

The benchmark judges its variants against another result of the same run
(the sequential path's, in the same dtype) without the operands:
:func:`results_bound` is the same per-element bound (:func:`element_bound`)
with the magnitudes estimated from that result's rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}

# fp32: the plain product's error is ~1e-7 relative; 1e-6 leaves room for a
# different (equally valid) summation order without admitting a wrong element.
_FLOOR = {torch.float32: 1e-6, torch.float16: 1e-5, torch.bfloat16: 1e-4}


_FP32_SUM = (
    2.0**-24
)  # the fp32 accumulators' unit roundoff: K summed products err by <= K * 2**-24 * sum|a b|


def element_bound(
    reference: torch.Tensor,
    magnitude: torch.Tensor,
    k: int,
    dtype: torch.dtype,
    rounded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per element, ``2 * (u * |reference| + k * 2**-24 * magnitude + u * rounded)``:
    the output's rounding to ``dtype`` (unit roundoff u), the standard bound on
    summing k fp32 products (gamma_k ~ k * 2**-24 times ``magnitude`` = sum |a b|),
    and, where partial sums travel in ``dtype``, their roundings (``rounded``: the
    sum of their magnitudes). Each term bounds one result's distance from the
    exact product whatever its summation order; the factor 2 covers a second
    result (two valid results lie within twice it of each other) or, against
    the exact product, the margin for a different but equally valid order."""
    u = _UNIT_ROUNDOFF[dtype]
    bound = u * reference.abs() + k * _FP32_SUM * magnitude
    if rounded is not None:
        bound = bound + u * rounded
    return 2 * bound


# A Gaussian value exceeds 7 standard deviations with probability 2.6e-12: none
# of the ~1e10 values of a benchmark run does (results_bound's partial sums).
_TAIL = 7.0


def results_bound(
    result: torch.Tensor, dtype: torch.dtype, k: int, partials: int = 0
) -> torch.Tensor:
    """How far another valid result of the same products may lie from ``result``
    [rows, N], per element: :func:`element_bound`, with what it needs of the
    operands estimated from ``result``'s rows (the benchmark keeps results, not
    operands). ``dtype``: the coarser of the two results' dtypes; ``k``: the
    accumulation length (every rank's K of a reduced product together);
    ``partials``: the partial sums either result rounds to ``dtype`` on the way
    (a reduced product through NCCL: world partials and world - 1 running sums).

    The estimates hold for operands whose second factor has independent
    zero-mean entries (the benchmark's Gaussian inputs), scale s_b. A row's
    RMS is then ||a_i||_2 * s_b, and ``magnitude`` = sum_k |a_ik b_kj| is about
    ||a_i||_1 * E|b| <= sqrt(k) * ||a_i||_2 * 0.8 * s_b (Cauchy-Schwarz; E|b| =
    0.8 s_b for a Gaussian): sqrt(k) * RMS bounds it with 25% to spare. A
    partial or running sum is Gaussian with an RMS of at most the row's, so
    each is within _TAIL RMS: ``rounded`` = partials * _TAIL * RMS."""
    ref = result.float()
    rms = ref.square().mean(dim=-1, keepdim=True).sqrt()
    rounded = partials * _TAIL * rms if partials else None
    return element_bound(ref, math.sqrt(k) * rms, k, dtype, rounded)


def worst_excess(
    out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor
) -> tuple[float, tuple[int, int]]:
    """max |out - ref| / bound over the elements (inf where out is NaN or Inf,
    or a difference meets a zero bound) and where it is; 0 when out == ref."""
    diff = (out.float() - ref.float()).abs()
    ratio = torch.where(diff == 0, 0.0, diff / bound)
    ratio = torch.where(ratio.isnan(), math.inf, ratio)
    if ratio.numel() == 0:
        return 0.0, (0, 0)
    flat = int(ratio.argmax())
    return float(ratio.view(-1)[flat]), divmod(flat, ratio.shape[-1])


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return ((result.double() - reference).norm() / reference.norm().clamp_min(1e-300)).item()


@dataclass
class MatmulVerdict:
    error: float  # relative (Frobenius) error of the result against fp64
    allowed: float  # the bound on it: twice the plain product's error, plus the floor
    plain_error: float  # the plain product's own relative error in the same dtype
    problem: str | None  # None when the result passes both checks, else what is wrong


def _judge(out, reference, plain, dtype, per_element_bound) -> MatmulVerdict:
    """Both checks: the norm against twice ``plain``'s error, then every element
    against ``per_element_bound()`` (computed only when the norm passes)."""
    plain_error = relative_error(plain, reference)
    allowed = 2 * plain_error + _FLOOR[dtype]
    if out.shape != reference.shape:
        return MatmulVerdict(float("inf"), allowed, plain_error, f"shape {tuple(out.shape)}")
    if out.isnan().any():
        return MatmulVerdict(
            float("nan"), allowed, plain_error, "NaN in the output (an unwritten tile?)"
        )
    error = relative_error(out, reference)
    if error > allowed:
        return MatmulVerdict(
            error, allowed, plain_error, f"relative error {error:.3g} > allowed {allowed:.3g}"
        )
    excess = (out.double() - reference).abs() - per_element_bound()
    if excess.max() > 0:
        row, col = divmod(int(excess.argmax()), reference.shape[1])
        problem = f"element [{row}, {col}] is {out[row, col].item()}, reference {reference[row, col].item()}"
        return MatmulVerdict(error, allowed, plain_error, problem)
    return MatmulVerdict(error, allowed, plain_error, None)


def judge_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> MatmulVerdict:
    """Judge ``out`` == a @ b by both checks of this module's docstring."""
    reference = a.double() @ b.double()
    plain = (a.float() @ b.float()).to(a.dtype) if a.dtype != torch.float32 else a @ b

    def bound() -> torch.Tensor:
        magnitude = a.double().abs() @ b.double().abs()
        return element_bound(reference, magnitude, a.shape[1], a.dtype)

    return _judge(out, reference, plain, a.dtype, bound)


def judge_reduced_matmul(
    out: torch.Tensor,
    xs: list[torch.Tensor],
    ws: list[torch.Tensor],
    addends: Sequence[torch.Tensor] = (),
) -> MatmulVerdict:
    """Judge ``out`` == sum_r xs[r] @ ws[r] (module docstring: reduced products),
    plus ``addends`` (a bias, a residual: broadcast to out's shape) added in fp32
    before the one rounding: each addition rounds at most 2**-24 of the running
    sum, which is at most the products' magnitude plus the addends'."""
    dtype = xs[0].dtype
    added = sum((a.double() for a in addends), torch.zeros((), dtype=torch.float64))
    reference = sum(x.double() @ w.double() for x, w in zip(xs, ws)) + added
    partials = [(x.float() @ w.float()).to(dtype).double() for x, w in zip(xs, ws)]

    def bound() -> torch.Tensor:
        k_total = sum(x.shape[1] for x in xs)
        magnitude = sum(x.double().abs() @ w.double().abs() for x, w in zip(xs, ws))
        bound = element_bound(reference, magnitude, k_total, dtype, sum(p.abs() for p in partials))
        if addends:
            added_magnitude = magnitude + sum(a.double().abs() for a in addends)
            bound = bound + 2 * len(addends) * _FP32_SUM * added_magnitude
        return bound

    return _judge(out, reference, (sum(partials) + added).to(dtype), dtype, bound)


# d/dg silu(g) = s(g) * (1 + g * (1 - s(g))), s the sigmoid, lies in [-0.1, 1.0999].
_SILU_SLOPE = 1.1


def judge_swiglu_matmul(
    out: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor
) -> MatmulVerdict:
    """Judge ``out`` == silu(x @ w_gate) * (x @ w_up). Plain: both products rounded
    to the dtype (a GEMM's output), then silu(gate) * up in fp32, rounded once (an
    elementwise kernel). Per element: the products' fp32 sums (K * 2**-24 of
    |x| @ |w| each, as judge_matmul) carried through silu (slope at most 1.1) and
    the product, the fp32 sigmoid and products (8 * 2**-24 relative: an exp, a
    division, two products), and the one rounding (u), doubled for another order."""
    gate, up = x.double() @ w_gate.double(), x.double() @ w_up.double()
    reference = torch.nn.functional.silu(gate) * up
    dtype = x.dtype
    gate_d, up_d = ((x.float() @ w.float()).to(dtype).float() for w in (w_gate, w_up))
    plain = (torch.nn.functional.silu(gate_d) * up_d).to(dtype)

    def bound() -> torch.Tensor:
        gamma = x.shape[1] * _FP32_SUM
        gate_err = gamma * (x.double().abs() @ w_gate.double().abs())
        up_err = gamma * (x.double().abs() @ w_up.double().abs())
        carried = (
            _SILU_SLOPE * gate_err * (up.abs() + up_err)
            + torch.nn.functional.silu(gate).abs() * up_err
        )
        u = _UNIT_ROUNDOFF[dtype]
        return 2 * ((u + 8 * _FP32_SUM) * reference.abs() + carried)

    return _judge(out, reference, plain, dtype, bound)


def judge_normed_matmul(
    out: torch.Tensor, x: torch.Tensor, gain: torch.Tensor, eps: float, w: torch.Tensor
) -> MatmulVerdict:
    """Judge ``out`` == rmsnorm(x, eps) * gain @ w. Plain: the normed rows rounded
    to the dtype (a norm kernel's output), then the product, rounded. Per
    element: the normed rows' rounding (u of each, so u * (|normed| @ |w|)),
    the fp32 sum of K products (K * 2**-24 of that magnitude), 1 / rms from K
    fp32 squares and a few fp32 steps ((K + 8) * 2**-24 relative, bounded by the
    same magnitude), and the output's rounding (u), doubled for another order."""
    normed = rmsnorm_reference(x, gain, eps)
    reference = normed @ w.double()
    dtype = x.dtype
    xf = x.float()
    normed_d = (xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + eps) * gain.float()).to(dtype)
    plain = (normed_d.float() @ w.float()).to(dtype)

    def bound() -> torch.Tensor:
        u = _UNIT_ROUNDOFF[dtype]
        magnitude = normed.abs() @ w.double().abs()
        return 2 * (u * reference.abs() + (u + (2 * x.shape[1] + 8) * _FP32_SUM) * magnitude)

    return _judge(out, reference, plain, dtype, bound)


def check_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str = "") -> float:
    """Assert ``out`` == a @ b by both checks; return its relative error."""
    verdict = judge_matmul(out, a, b)
    assert verdict.problem is None, f"{what}: {verdict.problem}"
    return verdict.error


def poisoned(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An output buffer full of NaN, so a tile the kernel never wrote shows."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def moe_mlp_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: list,
    w_down: list,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer for one rank's tokens: (fp64 result, the plain algorithm in x's dtype).

    ``w_gate_up[r]`` [E_local, H, 2F] and ``w_down[r]`` [E_local, F, H] are rank
    r's experts. The plain algorithm rounds where every implementation must
    (each GEMM's output, the activation, each expert's output) and sums a
    token's weighted outputs in fp32. Judge a result by its norm against twice
    the plain error (as ``judge_matmul`` does): the activation makes a
    per-element bound loose enough to be meaningless."""
    dtype, e_local = x.dtype, w_gate_up[0].shape[0]
    reference = torch.zeros(x.shape[0], w_down[0].shape[2], dtype=torch.float64)
    plain = torch.zeros_like(reference, dtype=torch.float32)
    for t, j in (topk_ids >= 0).nonzero().tolist():
        owner, e = divmod(int(topk_ids[t, j]), e_local)
        wg, wd, weight = w_gate_up[owner][e], w_down[owner][e], float(topk_weights[t, j])
        gate, up = (x[t].double() @ wg.double()).chunk(2)
        reference[t] += weight * ((torch.nn.functional.silu(gate) * up) @ wd.double())
        gate, up = (x[t].float() @ wg.float()).to(dtype).float().chunk(2)
        act = (torch.nn.functional.silu(gate) * up).to(dtype)
        plain[t] += weight * (act.float() @ wd.float()).to(dtype).float()
    return reference, plain.to(dtype)


def judge_moe(out: torch.Tensor, reference: torch.Tensor, plain: torch.Tensor) -> MatmulVerdict:
    """Judge an MoE layer's output by its norm (see :func:`moe_mlp_reference`)."""
    return _judge(
        out, reference, plain, out.dtype, lambda: torch.full_like(reference, float("inf"))
    )


def check_sum(
    out: torch.Tensor, xs: Sequence[torch.Tensor], what: str = "", *, in_dtype: int = 0
) -> None:
    """Assert ``out`` == sum_r xs[r] element by element: the sum rounded once to the
    dtype (u * |sum|) plus fp32 summation of len(xs) terms, with a factor 2 for
    another valid order (module docstring); ``in_dtype`` more roundings of partial
    sums of xs[:-1] where a collective adds in the dtype (NCCL's or gloo's
    all-reduce: world - 1), each at most u * sum |x|."""
    dtype = xs[0].dtype
    u = _UNIT_ROUNDOFF[dtype]
    reference = sum(x.double() for x in xs)
    magnitude = sum(x.double().abs() for x in xs)
    bound = 2 * (u * reference.abs() + len(xs) * 2.0**-24 * magnitude + in_dtype * u * magnitude)
    _assert_within(out, reference, bound, what)


def rmsnorm_reference(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``r / sqrt(mean(r**2, rows) + eps) * weight`` in fp64."""
    r = r.double()
    return r * torch.rsqrt(r.pow(2).mean(dim=1, keepdim=True) + eps) * weight.double()


def check_add_rmsnorm(
    normed: torch.Tensor,
    residual_out: torch.Tensor,
    xs: Sequence[torch.Tensor],
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    what: str = "",
    *,
    in_dtype: int = 0,
) -> None:
    """Assert ``residual_out`` == residual + sum_r xs[r] (as :func:`check_sum`, the
    residual one more term, ``in_dtype`` roundings of a collective's sum more) and
    ``normed`` == rmsnorm(residual_out) * weight, the norm taken in fp64 of the
    returned ``residual_out``: rounding ``normed`` once (u) plus fp32 statistics
    over N values (N * 2**-24 relative), doubled."""
    terms = [*xs, residual] if residual is not None else list(xs)
    check_sum(residual_out, terms, f"{what}: residual_out", in_dtype=in_dtype)
    reference = rmsnorm_reference(residual_out, weight, eps)
    u = _UNIT_ROUNDOFF[normed.dtype]
    bound = 2 * (u + residual_out.shape[1] * 2.0**-24) * reference.abs() + 2.0**-60
    _assert_within(normed, reference, bound, f"{what}: normed")


def _assert_within(out: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor, what: str):
    assert out.shape == reference.shape, (
        f"{what}: shape {tuple(out.shape)}, expected {tuple(reference.shape)}"
    )
    assert not out.isnan().any(), f"{what}: NaN in the output (an unwritten block?)"
    excess = (out.double() - reference).abs() - bound
    if excess.numel() and excess.max() > 0:
        row, col = divmod(int(excess.argmax()), reference.shape[1])
        raise AssertionError(
            f"{what}: element [{row}, {col}] is {out[row, col].item()}, "
            f"reference {reference[row, col].item()} (bound {bound[row, col].item():.3g})"
        )
