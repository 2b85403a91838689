"""matmul: the local persistent GEMM core of the fused ops, alone (no waits).

The floor of every fused op's time; benchmarked against cuBLAS on its own.
Its config is ag_gemm's at world 1; where that config names ``wave_fill_tiles``,
a shape takes those tiles or its own, whichever fill the persistent grid's last
wave fuller (:func:`tiles_by_wave_fill`).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from ..kernels.gemm import last_wave_fill, launch_chunked_gemm, mblock_table
from ..runtime.platform import num_sms
from ..tuning import build_config, shape_key
from .ag_gemm import AgGemmConfig
from .checks import (
    TILE_FIELDS,
    check_gemm_operands,
    check_out,
    check_tiles_fit,
    epilogue_for_new_out,
    new_out,
    refuse_grad,
    require,
    resolve_epilogue,
    tma_aligned,
    tma_layout_blocker,
    with_wave_fill_tiles,
)
from .plans import LOCAL, plan_for, signature

OP = "matmul"


def matmul(
    a: torch.Tensor,  # [M, K]
    b: torch.Tensor,  # [K, N]: row-major or weight.t()
    config: AgGemmConfig | dict | None = None,
    *,
    out: torch.Tensor | None = None,  # [M, N]
) -> torch.Tensor:
    """``a @ b`` with the chunk-aware persistent GEMM and the ag_gemm template's tiles
    (no gradient recorded: torch.matmul's where one is needed)."""
    refuse_grad(OP, a, b)
    plan = plan_for(OP, signature(OP, a, b, LOCAL, config), lambda: MatmulPlan(a, b, config))
    return plan(a, b, out)


def matmul_config(
    m: int,
    k: int,
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    config: AgGemmConfig | dict | None = None,
) -> AgGemmConfig:
    """The config a matmul of [m, k] @ [k, n] runs: ag_gemm's at world 1 (defaults,
    template, tuned table, ``config``: tuning.build_config), with the tiles
    :func:`tiles_by_wave_fill` takes on the device's SMs, each tile choice checked to
    fit. A ``config`` dict that sets a tile field (checks.TILE_FIELDS) and not
    ``wave_fill_tiles`` runs the tiles it names."""
    if _names_tiles_alone(config):
        config = {**config, "wave_fill_tiles": ()}
    cfg = build_config(AgGemmConfig, "ag_gemm", shape_key(1, m, k, n, dtype), config, device=device)
    for tiles in (cfg, with_wave_fill_tiles(cfg)) if cfg.wave_fill_tiles else (cfg,):
        check_tiles_fit(OP, tiles, dtype, device, store_buffer=tiles.epilogue == "tma")
    return tiles_by_wave_fill(cfg, m, n, num_sms(device))


def _names_tiles_alone(config: AgGemmConfig | dict | None) -> bool:
    """Whether a caller's ``config`` dict sets tile fields and no wave-fill alternative."""
    return (
        isinstance(config, dict)
        and "wave_fill_tiles" not in config
        and bool(set(config) & set(TILE_FIELDS))
    )


def tiles_by_wave_fill(cfg: AgGemmConfig, m: int, n: int, programs: int) -> AgGemmConfig:
    """``cfg`` with its own tiles or its ``wave_fill_tiles``, whichever fill the last wave
    of ``programs`` persistent programs over an [m, n] output fuller (a tie keeps its own);
    ``wave_fill_tiles`` emptied, so the result names what runs. A persistent grid's time
    is its waves', and a short last wave idles the rest of the SMs for about a tile's
    time. The split tail is not counted: counting its K pieces as filling the wave chose
    worse on the shapes measured (templates/ag_gemm.toml). A function of the shape, the
    config and the program count alone, so every call of one shape on one kind of GPU
    takes the same tiles."""
    if not cfg.wave_fill_tiles:
        return cfg
    other = with_wave_fill_tiles(cfg).validate()
    if _last_wave_fill(other, m, n, programs) > _last_wave_fill(cfg, m, n, programs):
        return other
    return dataclasses.replace(cfg, wave_fill_tiles=())


def _last_wave_fill(cfg: AgGemmConfig, m: int, n: int, programs: int) -> float:
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return last_wave_fill(tiles, programs)


class MatmulPlan:
    """The checks, config and M-block order of one signature (ops/plans.py)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, config):
        check_gemm_operands(OP, a, b, "a", "b")
        blocker = tma_layout_blocker(a, b)
        require(blocker is None, OP, f"{blocker}; use torch.matmul for such shapes")
        cfg = matmul_config(a.shape[0], a.shape[1], b.shape[1], a.dtype, a.device, config)
        self.cfg = epilogue_for_new_out(OP, cfg, b.shape[1], a.dtype)
        self.out_shape = (a.shape[0], b.shape[1])
        self.row_order = mblock_table([(0, a.shape[0], -1, 0)], cfg.block_m, a.device)
        self.programs = num_sms(a.device)
        # (epilogue, out's row stride) -> the launch made again (kernels/relaunch.py): at
        # decode sizes host time is a call's time, and Triton's own launch path redoes
        # per-call work a relaunch skips
        self.relaunches: dict = {}

    def __call__(self, a, b, out):
        cfg = self.cfg
        if out is None:
            out = new_out(self.out_shape, a)
        else:
            check_out(OP, out, self.out_shape, a, a, b)
            cfg = resolve_epilogue(OP, cfg, out, self.out_shape[1])
        if min(self.out_shape) == 0:
            return out
        if a.shape[1] == 0:
            return out.zero_()
        a, b = tma_aligned(a), tma_aligned(b)
        key = (cfg.epilogue, out.stride(0))
        again = self.relaunches.get(key)
        if again is None or not again(a, b, out):
            self.relaunches[key] = launch_chunked_gemm(
                a, b, out, self.row_order, cfg, self.programs
            )
        return out
