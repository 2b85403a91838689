"""Config checks that need no tensors on a device (they run on CPU-only machines)."""

from __future__ import annotations

import re

import pytest
import torch

import overlap_kernels as ok
from overlap_kernels.ops.checks import SHARED_MEMORY_BYTES, check_tiles_fit

CUDA = torch.device("cuda")  # only its type is read: no GPU needed


@pytest.mark.parametrize("cls", [ok.AgGemmConfig, ok.GemmRsConfig, ok.GemmArConfig])
def test_tiles_that_do_not_fit_in_shared_memory_are_rejected(cls):
    # The dataclass default 128x256x64 x 3 stages: 147,456 bytes in bf16 (fits),
    # twice that in fp32 (does not: the compiled kernel would fail at launch).
    check_tiles_fit("op", cls(), torch.bfloat16, CUDA)
    with pytest.raises(
        ok.OverlapInputError, match=r"op: config: 3 stages .* float32 tiles need 294912 bytes"
    ):
        check_tiles_fit("op", cls(), torch.float32, CUDA)
    check_tiles_fit("op", cls(block_k=32), torch.float32, CUDA)


def test_the_limit_is_the_bytes_and_the_interpreter_has_none():
    fits = ok.GemmArConfig(
        block_m=64, block_n=64, block_k=128, num_stages=SHARED_MEMORY_BYTES // (128 * 128 * 2)
    )
    check_tiles_fit("op", fits, torch.bfloat16, CUDA)
    too_many = ok.GemmArConfig(block_m=64, block_n=64, block_k=128, num_stages=fits.num_stages + 1)
    with pytest.raises(ok.OverlapInputError):
        check_tiles_fit("op", too_many, torch.bfloat16, CUDA)
    check_tiles_fit("op", too_many, torch.bfloat16, torch.device("cpu"))


def test_the_tma_store_tile_counts_against_shared_memory():
    """The chunked GEMM's "tma" epilogue keeps a block_m x block_n tile beside
    the staged ones (213,016 bytes compiled at 128x256x64 bf16, 3 stages):
    3 stages fit, 4 stages and fp32's 128x256x32 tiles do not."""
    tma = ok.AgGemmConfig(epilogue="tma")
    check_tiles_fit("ag_gemm", tma, torch.bfloat16, CUDA, store_buffer=True)
    for cfg, dtype in (
        (ok.AgGemmConfig(num_stages=4), torch.bfloat16),
        (ok.AgGemmConfig(block_k=32), torch.float32),
    ):
        check_tiles_fit("ag_gemm", cfg, dtype, CUDA)  # fits without the store tile
        with pytest.raises(
            ok.OverlapInputError, match="tile for TMA stores need .* or use epilogue pointer"
        ):
            check_tiles_fit("ag_gemm", cfg, dtype, CUDA, store_buffer=True)


@pytest.mark.parametrize(
    "op, cls",
    [("ag_gemm", ok.AgGemmConfig), ("gemm_rs", ok.GemmRsConfig), ("gemm_ar", ok.GemmArConfig),
     ("moe", ok.MoeConfig)],
)  # fmt: skip
def test_every_cuda_template_entry_is_valid_and_fits_in_shared_memory(op, cls):
    """The [cuda] section and each [[cuda.shapes]] entry, for the dtypes it can
    meet (an entry naming a dtype: that one; otherwise all three), as the
    tuning layer merges them."""
    from overlap_kernels.tuning import load_template

    template = load_template(op)
    fields = set(cls.__dataclass_fields__)
    base = {
        **template.get("common", {}),
        **{k: v for k, v in template["cuda"].items() if k != "shapes"},
    }
    entries = [{}] + template["cuda"].get("shapes", [])
    for entry in entries:
        values = {**base, **{k: v for k, v in entry.items() if k in fields}}
        cfg = cls(**values).validate()  # (every value valid: loads, epilogue, mechanism, ...)
        dtypes = (
            [getattr(torch, entry["dtype"])]
            if "dtype" in entry
            else [torch.bfloat16, torch.float16]
        )
        for dtype in dtypes:
            check_tiles_fit(
                op,
                cfg,
                dtype,
                CUDA,
                store_buffer=op in ("ag_gemm", "moe") and cfg.epilogue == "tma",
            )


@pytest.mark.parametrize(
    "knobs, message",
    [({"group_m": 0}, "group_m must be >= 1, got 0"),
     ({"epilogue": "stmatrix"}, "epilogue must be pointer or tma, got 'stmatrix'")],
)  # fmt: skip
def test_the_moe_config_names_a_bad_tile_order_or_epilogue(knobs, message):
    with pytest.raises(ok.OverlapInputError, match=f"moe: config: {message}"):
        ok.MoeConfig(**knobs).validate()


@pytest.mark.parametrize("cls", [ok.AgGemmConfig, ok.GemmRsConfig, ok.GemmArConfig])
def test_tma_epilogue_falls_back_to_pointer_where_tma_cannot_store(cls):
    """TMA stores need 16-byte aligned rows and bases: an fp16 row of 36
    elements (72 bytes) or an out that starts 2 bytes into its storage takes the
    pointer epilogue; an aligned one keeps TMA. Both store the same values."""
    from overlap_kernels.ops.checks import resolve_epilogue

    cfg = cls(epilogue="tma")
    assert (
        resolve_epilogue("op", cfg, torch.empty(8, 40, dtype=torch.float16), 40).epilogue == "tma"
    )
    assert (
        resolve_epilogue("op", cfg, torch.empty(8, 36, dtype=torch.float16), 36).epilogue
        == "pointer"
    )
    shifted = torch.empty(8 * 40 + 1, dtype=torch.float16)[1:].view(8, 40)
    assert resolve_epilogue("op", cfg, shifted, 40).epilogue == "pointer"
    assert (
        resolve_epilogue(
            "op", cls(epilogue="pointer"), torch.empty(8, 40, dtype=torch.float16), 40
        ).epilogue
        == "pointer"
    )


def test_gemm_rs_cuda_template_measures_the_mechanism_and_cuts_large_m_in_pieces():
    """The [[cuda.shapes]] entries as tuning.py matches them (first match wins)."""
    from overlap_kernels.tuning import _matches, load_template, shape_key

    template = load_template("gemm_rs")
    entries = template["cuda"]["shapes"]

    def field(name, world, m, dtype=torch.bfloat16):
        shape = shape_key(world, m, 7168, 8192, dtype)
        entry = next((e for e in entries if _matches(e, shape)), {})
        return entry.get(name, template["cuda"].get(name, template["common"].get(name)))

    assert {field("mechanism", world, m) for world in (2, 4, 8) for m in (2048, 16384)} == {"push"}
    assert [field("pieces", 4, m) for m in (2048, 4096, 8192, 8193, 16384)] == [1, 1, 1, 4, 4]
    assert field("pieces", 4, 16384, torch.float32) == 1  # the fp32 entry matches first


def test_templates_name_valid_fixed_choices():
    """Every template section makes a valid config with no measured value: a
    measured choice comes from a tuned table or autotune(), never a template."""
    from overlap_kernels.tuning import load_template

    for op, cls in (
        ("ag_gemm", ok.AgGemmConfig),
        ("gemm_rs", ok.GemmRsConfig),
        ("gemm_ar", ok.GemmArConfig),
    ):
        template = load_template(op)
        for section in ("cuda", "interpreter"):
            values = {
                **template["common"],
                **{k: v for k, v in template[section].items() if k != "shapes"},
            }
            assert "fastest" not in values.values(), (op, section)
            cls(**values).validate()


def _gemm_ar_paths_body(rank: int, world: int) -> list[str]:
    from overlap_kernels.ops.gemm_ar import GemmArConfig, resolve_path
    from overlap_kernels.tuning import build_config, shape_key

    x, w = (
        torch.zeros(8, 32),
        torch.zeros(32, 48),
    )  # M = 8: one_shot's size in the interpreter's template
    cfg = build_config(GemmArConfig, "gemm_ar", shape_key(world, 8, 32, 48, x.dtype), None)
    return [
        resolve_path(x, w, world, cfg, has_schedule=schedule, forced=False)[0]
        for schedule in (False, True)
    ]


def test_gemm_ar_takes_two_shot_where_a_schedule_rules_out_one_shot():
    from overlap_kernels.launch import run_ranks

    assert run_ranks(_gemm_ar_paths_body, 2) == [["one_shot", "two_shot"]] * 2


def test_gemm_ar_autotune_measures_one_shot_wherever_its_flags_fit():
    """Up to one_shot_max_m: one_shot and the pair; above it two_shot's candidates,
    the pair and one_shot while a flag per tile fits; past that, no one_shot."""
    from overlap_kernels.limits import writer_flags
    from overlap_kernels.ops.gemm_ar import autotune_changes

    cfg = ok.GemmArConfig(one_shot_max_m=64, block_m=128, block_n=256)
    n, world = 8192, 2
    fitting_m = writer_flags(world) // (n // 256) * 128  # the most rows one_shot takes

    def paths(m):
        return [change["path"] for change in autotune_changes(m, n, world, cfg)]

    assert paths(64) == ["one_shot", "sequential"]
    assert paths(256).count("two_shot") >= 2 and paths(256)[-2:] == ["sequential", "one_shot"]
    assert paths(fitting_m)[-1] == "one_shot"
    assert "one_shot" not in paths(fitting_m + 1)


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar", "matmul"])
def test_operands_that_require_grad_are_refused(op):
    """The ops record no gradient: an operand that requires grad (grad mode on)
    gets an error naming the differentiable way, before anything else; under
    no_grad the check lets it through (matmul then runs)."""
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    alternative = "torch.matmul" if op == "matmul" else f"torch.ops.overlap_kernels.{op}"
    for needs_grad in (x, w):
        needs_grad.requires_grad_(True)
        with pytest.raises(
            ok.OverlapInputError,
            match=rf"^{op}: an operand requires grad.*{re.escape(alternative)}",
        ):
            getattr(ok, op)(x, w)
        needs_grad.requires_grad_(False)
    with torch.no_grad():
        x.requires_grad_(True)
        if op == "matmul":
            torch.testing.assert_close(ok.matmul(x, w), x @ w)
