"""bench.gemm_cores on CPU (Triton's interpreter): each core's launch, as ``bench.tune_gemm``
times it, computes the product; and the sweep's rows, ratios and choice.

The cores run in one spawned rank of a one-rank gloo group (the reduce core's workspace
is made on it), with the interpreter's template tiles and one swept config each, on shapes
whose M, K, N and expert sizes are not multiples of the tiles (K 72 and N 104: multiples
of 8, as TMA needs 16-byte rows). Times on CPU mean nothing.
"""

from __future__ import annotations

import pytest
import torch

from bench import gemm_cores, tune_gemm
from overlap_kernels.launch import run_ranks

K = 72
DENSE_SHAPE, DECODE_SHAPE, GROUPED_SHAPE = (40, K, 104), (3, K, 104), (3, 20, K, 56)
# bf16 output of an fp32 product: rounding to bf16 (8 significant bits) is off by at most
# 2^-8 relative per element, so in norm too; fp32 sums over K add at most K * 2^-24 relative
# (Higham's bound with |a||b| ~ |ab| for these sums of a few terms). A wrong row, tile or
# expert is O(1).
TOL = 2.0**-8 + K * 2.0**-24
SWEPT = {  # a config of each core other than the interpreter template's
    "dense": (16, 16, 32, 4, 1, 1, "tma"),
    # groups of 2 row blocks, whole blocks stored by TMA, operands by masked loads
    "grouped_gemm": (16, 16, 32, 4, 1, 2, "tma", "pointer_loads"),
}


def _errors(rank: int, world: int) -> dict[str, float]:
    device = torch.device("cpu")
    errors = {}
    forward, dgrad = gemm_cores.FORWARD, gemm_cores.DGRAD
    for name, core in gemm_cores.CORES.items():
        cases = ((GROUPED_SHAPE, forward),) if name == "grouped_gemm" else \
            ((DENSE_SHAPE, forward), (DECODE_SHAPE, forward), (DENSE_SHAPE, dgrad))  # fmt: skip
        for shape, layout in cases:
            torch.manual_seed(0)
            problem = core.problem(shape, device, layout)
            if name != "grouped_gemm":  # (the forward's B: weight.t(), not row-major)
                assert problem.b.is_contiguous() == (layout == dgrad)
            template = gemm_cores.template_knobs(name, problem.shape, device)
            swept = gemm_cores.knobs_of(name, SWEPT.get(name, SWEPT["dense"]))
            for label, knobs in (("template", template), ("swept", swept)):
                problem.out.fill_(float("nan"))
                core.ours(problem, knobs)()
                err = (problem.out.float() - problem.reference).norm() / problem.reference.norm()
                errors[f"{name} {shape} {layout} {label}"] = err.item()
    return errors


def test_every_core_computes_its_product_as_tune_gemm_launches_it():
    (errors,) = run_ranks(_errors, 1, timeout_s=900)
    assert len(errors) == 2 * (3 * 3 + 1)
    bad = {k: v for k, v in errors.items() if not v <= TOL}  # (NaN fails: an unwritten out)
    assert not bad, bad


def test_the_grouped_core_launches_the_tile_order_its_config_names():
    from overlap_kernels.ops.moe_details.layout import grouped_tiles

    core = gemm_cores.CORES["grouped_gemm"]
    problem = core.problem(GROUPED_SHAPE, torch.device("cpu"))
    experts, rows, _, n = GROUPED_SHAPE
    for group_m in (1, 2):
        knobs = gemm_cores.knobs_of("grouped_gemm", (16, 16, 32, 4, 1, group_m))
        core.ours(problem, knobs)
        expected = grouped_tiles([rows] * experts, 16, 16, n, group_m=group_m)
        assert (problem.keep["table"].numpy() == expected).all()
    assert not (expected == grouped_tiles([rows] * experts, 16, 16, n)).all()  # (they differ)


def _row(
    vendor_ms: float, variants: dict[str, float], errs: dict[str, float] | None = None
) -> dict:
    row = {"shape": {"M": 8, "K": 16, "N": 32}, "held_out": False, "flops": 2.0 * 8 * 16 * 32,
           "template_config": "128x256x64w8s3g8", "cublas": {"ms": vendor_ms}}  # fmt: skip
    for name, ms in variants.items():
        row[name] = {"ms": ms, "ms_rounds": [ms], "err": (errs or {}).get(name, 1e-3)}
    return row


def test_best_is_the_fastest_correct_config_and_ratios_are_to_the_vendor():
    core = gemm_cores.CORES["matmul"]
    row = _row(1.0, {"template": 1.05, "64x64x64w4s3g8": 0.99, "32x32x32w4s3g8": 0.5},
               errs={"32x32x32w4s3g8": 0.3})  # fast, but wrong: never the best  # fmt: skip
    assert tune_gemm.best(row, core) == "64x64x64w4s3g8"
    assert tune_gemm.ratio(row, core, "template") == pytest.approx(1.05)
    assert tune_gemm.ratio(row, core, "absent") is None


def test_rows_name_the_template_config_and_held_out_shapes(capsys):
    core = gemm_cores.CORES["matmul"]
    held = {**_row(2.0, {"template": 2.1}), "held_out": True}
    failed = {**_row(1.0, {"template": 1.0}), "64x64x64w4s3g8": {"error": "OutOfResources: smem"}}
    rows = tune_gemm.rows_of(core, [failed, held])
    by = {(r["variant"], r["config"].get("held_out", False)): r for r in rows}
    assert by[("template", False)]["config"] == {"tiles": "128x256x64w8s3g8"}
    assert by[("64x64x64w4s3g8", False)]["status"] == "error"
    assert "OutOfResources" in by[("64x64x64w4s3g8", False)]["note"]
    assert by[("template", True)]["ms"] == 2.1 and by[("cublas", True)]["config"] == {
        "held_out": True
    }
    tune_gemm.print_summary(core, [failed, held])
    out = capsys.readouterr().out
    assert "8x16x32*" in out and "1.050!" in out  # held out; the template past the bar
    assert "(* held out: the template's config alone)" in out
    tune_gemm.print_summary(core, [_row(1.0, {"template": 1.0})], template_only=True)
    assert (
        "(no configs swept: every shape ran the template's config alone)" in capsys.readouterr().out
    )


def test_config_names_tell_configs_apart():
    for core, configs in (("matmul", gemm_cores.DENSE_CONFIGS), ("matmul", gemm_cores.DENSE_DECODE_CONFIGS),
                          ("grouped_gemm", gemm_cores.GROUPED_CONFIGS),
                          ("grouped_gemm", gemm_cores.GROUPED_DECODE_CONFIGS)):  # fmt: skip
        names = [gemm_cores.config_name(gemm_cores.knobs_of(core, c)) for c in configs]
        assert len(set(names)) == len(names), names


def test_sweep_dedupes_the_template_reports_a_config_that_fails_and_times_in_rounds(monkeypatch):
    """tune_gemm.sweep on the matmul core on CPU, with do_bench replaced by a counter: the
    template's config runs once (as "template"), a config the op refuses is an error row,
    every other variant is timed once per round and checked against fp32."""
    import triton.testing

    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: calls.append(fn) or 1.0)
    core = gemm_cores.CORES["matmul"]
    device = torch.device("cpu")
    template = gemm_cores.template_knobs("matmul", {"M": 40, "K": K, "N": 104}, device)
    as_tuple = tuple(template[k] for k in ("block_m", "block_n", "block_k", "num_warps",
                                           "num_stages", "group_m"))  # fmt: skip
    refused = (24, 16, 32, 4, 1, 1)  # block_m 24: not a power of two
    row = tune_gemm.sweep(core, DENSE_SHAPE, (as_tuple, SWEPT["dense"], refused), 2, device)
    ours = [n for n in row if isinstance(row[n], dict) and n not in ("cublas", "shape")]
    assert set(ours) == {"template", "16x16x32w4s1g1+tma", "24x16x32w4s1g1"}
    assert "error" in row["24x16x32w4s1g1"] and "power of two" in row["24x16x32w4s1g1"]["error"]
    for name in ("template", "16x16x32w4s1g1+tma", "cublas"):
        assert row[name]["ms_rounds"] == [1.0, 1.0]
    assert row["template"]["err"] <= TOL and row["16x16x32w4s1g1+tma"]["err"] <= TOL
    assert len(calls) == 3 * 2  # three variants, two rounds


def test_rounds_change_which_call_follows_which(monkeypatch):
    import triton.testing

    def timed_orders(names, rounds, vary_order):
        order = []
        monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: order.append(fn()) or 1.0)
        calls = {name: (lambda name=name: name) for name in names}
        times, errors = gemm_cores.interleaved_medians(calls, rounds, vary_order=vary_order)
        assert not errors and all(t == [1.0] * rounds for t in times.values())
        return [order[i : i + len(names)] for i in range(0, len(order), len(names))]

    rounds = timed_orders("vabcd", 5, True)
    assert rounds[0] == list("vabcd")  # the first round in the callers' order
    assert all(r[0] == "v" and sorted(r) == list("abcdv") for r in rounds)  # each once a round
    assert [r[1] for r in rounds] == list("abcda")  # each follows the vendor's in turn
    assert [r[1] for r in timed_orders("vabcdef", 6, True)] == list("abcdef")  # (any count)
    assert timed_orders("vabcd", 3, False) == [list("vabcd")] * 3
    assert timed_orders("va", 2, True) == [["v", "a"]] * 2  # nothing else to put between
    assert timed_orders("v", 2, True) == [["v"], ["v"]]


def test_model_shapes_are_each_ranks_share_of_the_published_projections():
    from bench import model_shapes

    # Llama-3-70B at TP 4: the reduction points the decode GEMMs are judged at (o: 2048 of
    # 8192 input columns, down: 7168 of 28672), q/k/v with 8 KV heads (80 heads' worth of 128
    # columns, a quarter each), gate and up fused.
    assert model_shapes.MODELS["llama3_70b"].projections(4) == {
        "qkv": (8192, 2560), "gate_up": (8192, 14336), "o": (2048, 8192), "down": (7168, 8192),
    }  # fmt: skip
    points = model_shapes.reduction_points()
    assert (2048, 4096) in points and (7168, 8192) in points  # Llama-3-8B TP 2 o, 70B TP 4 down
    assert all(n in (4096, 5120, 8192, 12288) for _, n in points)  # N: a model's hidden size
    decode = model_shapes.shapes(ms=(1, 256))
    assert len(decode) == len(set(decode)) and {m for m, _, _ in decode} == {1, 256}
    assert decode == sorted(decode)
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        model_shapes.MODELS["llama3_8b"].projections(3)


def test_a_cores_run_of_every_tuned_on_shape_is_its_target_run():
    """bench.report keeps a newest run of each kind: a core's default sweep (every
    tuned-on shape) is TARGET; decode, model and given-shape sweeps, even ones that share a
    shape with it, are UNTUNED (so none hides the default sweep on the docs page)."""
    from bench import report

    core = gemm_cores.CORES["matmul"]

    def doc(shapes):
        return {"rows": [{"op": "matmul", "shape": dict(zip("MKN", s))} for s in shapes]}

    assert report.run_kind(doc(core.shapes + core.held_out)) == report.TARGET
    assert report.run_kind(doc(core.shapes[1:] + core.decode_shapes)) == report.UNTUNED
    assert report.run_kind(doc(core.decode_shapes)) == report.UNTUNED


def test_dgrad_sweeps_the_dense_cores_on_the_models_backward_shapes(capsys):
    core = gemm_cores.CORES["matmul"]
    forward = tune_gemm._default_shapes(core, True, True, False)
    dgrad = tune_gemm._default_shapes(core, True, True, True)
    assert sorted((m, n, k) for m, k, n in forward) == dgrad != forward
    grouped = gemm_cores.CORES["grouped_gemm"]
    assert tune_gemm._default_shapes(grouped, False, True, True) == []
    with pytest.raises(SystemExit):
        tune_gemm.main(["--dgrad", "--core", "grouped_gemm"])
    assert "--dgrad: the dense cores only" in capsys.readouterr().err
