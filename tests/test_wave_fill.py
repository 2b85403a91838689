"""The matmul core's tiles chosen by how full they leave the persistent grid's last wave
(config ``wave_fill_tiles``, ops/matmul.py): the rule on hand-counted tiles, the configs
the CUDA template resolves to on a 132-SM GPU, the knob's checks, and the product on
Triton's interpreter (4 programs there: platform.num_sms) with the template's tiles.
"""

from __future__ import annotations

import pytest
import torch

import overlap_kernels as ok  # (before Triton: it turns the interpreter on where no GPU is)
from overlap_kernels import tuning
from overlap_kernels.kernels.gemm import last_wave_fill
from overlap_kernels.ops import matmul as matmul_op
from overlap_kernels.ops.checks import TILE_FIELDS, check_tiles_fit, with_wave_fill_tiles
from overlap_kernels.reference import check_matmul, poisoned
from overlap_kernels.runtime.errors import OverlapInputError
from overlap_kernels.runtime.platform import num_sms

H200_SMS = 132
BF16 = torch.bfloat16
WIDE = {"block_m": 128, "block_n": 256, "num_warps": 8, "num_stages": 3, "group_m": 16}
NARROW = {"block_m": 64, "block_n": 256, "num_warps": 4, "num_stages": 4, "group_m": 8}


@pytest.fixture
def cuda_template(monkeypatch):
    """Template values read from the [cuda] section, as on a GPU."""
    monkeypatch.setattr(tuning, "INTERPRETER", False)
    tuning._template_values.cache_clear()
    yield
    tuning._template_values.cache_clear()


def _cuda_config(m: int, k: int, n: int, world: int = 1) -> ok.AgGemmConfig:
    return tuning.build_config(
        ok.AgGemmConfig, "ag_gemm", tuning.shape_key(world, m, k, n, BF16), None
    )


def _tiles(cfg: ok.AgGemmConfig) -> dict:
    return {name: getattr(cfg, name) for name in WIDE}


def test_last_wave_fill_is_the_share_of_programs_busy_in_the_last_wave():
    assert last_wave_fill(264, H200_SMS) == 1.0  # two even waves
    assert last_wave_fill(140, H200_SMS) == 8 / H200_SMS
    assert last_wave_fill(21, H200_SMS) == 21 / H200_SMS  # one short wave


@pytest.mark.parametrize(
    ("k", "n", "expected"),
    [
        # 13 x 20 = 260 tiles of 64 rows, 128 in the last wave; 7 x 20 = 140 of 128, 8 last
        (640, 5120, NARROW),
        # 13 x 32 = 416 tiles, 20 last; 7 x 32 = 224 tiles, 92 last
        (1024, 8192, WIDE),
        # 13 x 22 = 286 tiles and 7 x 22 = 154: 22 in each last wave, a tie
        (4096, 5632, WIDE),
    ],
)
def test_the_template_takes_the_tiles_with_the_fuller_last_wave_at_777_rows(
    cuda_template, k, n, expected
):
    cfg = _cuda_config(777, k, n)
    assert _tiles(cfg) == WIDE and dict(cfg.wave_fill_tiles) == {
        name: NARROW[name] for name in ("block_m", "num_warps", "num_stages", "group_m")
    }
    chosen = matmul_op.tiles_by_wave_fill(cfg, 777, n, H200_SMS)
    assert _tiles(chosen) == expected and chosen.block_k == 64
    assert chosen.wave_fill_tiles == ()  # (the result names what runs)
    assert chosen.split_tail  # (as the 64-row tiles were measured)


def test_matmul_config_resolves_on_the_devices_sms(cuda_template, monkeypatch):
    monkeypatch.setattr(matmul_op, "num_sms", lambda device: H200_SMS)
    cpu = torch.device("cpu")
    assert _tiles(matmul_op.matmul_config(777, 640, 5120, BF16, cpu)) == NARROW
    assert _tiles(matmul_op.matmul_config(777, 1024, 8192, BF16, cpu)) == WIDE
    # a caller's tiles run as named; with wave_fill_tiles of its own the rule applies
    assert matmul_op.matmul_config(777, 640, 5120, BF16, cpu, {"block_m": 128}).block_m == 128
    both = {"block_m": 128, "wave_fill_tiles": {"block_m": 64}}
    assert matmul_op.matmul_config(777, 640, 5120, BF16, cpu, both).block_m == 64


def test_only_matmuls_of_513_to_1024_rows_have_a_choice(cuda_template):
    for m, world in ((512, 1), (1025, 1), (2048, 1), (777, 2), (777, 4)):
        assert _cuda_config(m, 640, 5120, world).wave_fill_tiles == (), (m, world)


def test_the_wave_fill_tiles_fit_in_shared_memory_with_either_epilogue(cuda_template):
    """4 stages of 64x64 + 64x256 bf16 tiles are 163,840 bytes, 196,608 with the TMA
    epilogue's 64x256 tile: under the 232,448 one block may use."""
    narrow = with_wave_fill_tiles(_cuda_config(777, 640, 5120))
    for dtype in (torch.bfloat16, torch.float16):
        for store_buffer in (False, True):
            check_tiles_fit(
                "matmul", narrow, dtype, torch.device("cuda"), store_buffer=store_buffer
            )


def test_wave_fill_tiles_are_checked():
    shape = tuning.shape_key(1, 777, 640, 5120, BF16)
    for bad, match in (
        ({"epilogue": "tma"}, "wave_fill_tiles may set block_m"),
        ({"block_m": 48}, "block_m must be a power of two"),
    ):
        with pytest.raises(OverlapInputError, match=match):
            tuning.build_config(ok.AgGemmConfig, "ag_gemm", shape, {"wave_fill_tiles": bad})
    with pytest.raises(
        OverlapInputError, match="gemm_rs: config: wave_fill_tiles is read by matmul"
    ):
        tuning.build_config(ok.GemmRsConfig, "gemm_rs", shape, {"wave_fill_tiles": {"block_m": 64}})


def _template_tiles_at_777_rows() -> dict:
    """The CUDA template's tile fields and wave_fill_tiles (a TOML table) at 777 rows."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuning, "INTERPRETER", False)
        tuning._template_values.cache_clear()
        values = tuning.template_values("ag_gemm", tuning.shape_key(1, 777, 640, 5120, BF16))
    tuning._template_values.cache_clear()
    return {name: values[name] for name in (*TILE_FIELDS, "wave_fill_tiles")}


@pytest.mark.parametrize(
    ("n", "block_m"),
    [
        (200, 64),  # 2 tiles against 1 of the 4 programs: 64 rows, each tile cut in K pieces
        (300, 64),  # 4 tiles (a whole wave) against 2
        (600, 128),  # 6 tiles (2 in the last wave) against 3
    ],
)
def test_matmul_is_right_with_the_tiles_the_rule_takes(n, block_m):
    """The template's tiles on the interpreter's 4 programs, at sizes no tile divides."""
    assert num_sms(torch.device("cpu")) == 4
    torch.manual_seed(n)
    m, k = 100, 200
    config = _template_tiles_at_777_rows()
    assert matmul_op.matmul_config(m, k, n, BF16, torch.device("cpu"), config).block_m == block_m
    a = torch.randn(m, k, dtype=BF16)
    b = torch.randn(n, k, dtype=BF16).t()  # (nn.Linear's weight.t())
    out = ok.matmul(a, b, config, out=poisoned((m, n), BF16, "cpu"))
    check_matmul(out, a, b, f"matmul {m}x{k}x{n}, {block_m}-row tiles")
