"""Input checks shared by the ops: every message says what is wrong and what to do."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..runtime.collectives import backend_of
from ..runtime.errors import OverlapInputError

if TYPE_CHECKING:
    from .ag_gemm import AgGemmConfig
    from .gemm_ar import GemmArConfig
    from .gemm_rs import GemmRsConfig
    from .moe import MoeConfig

_log = logging.getLogger(__name__)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise OverlapInputError(f"{op}: {message}")


def check_group(
    op: str, group: dist.ProcessGroup | None, device: torch.device
) -> dist.ProcessGroup:
    """The group to use (default: WORLD), checked against this process and the device."""
    require(dist.is_available() and dist.is_initialized(), op,
            "torch.distributed is not initialised: call dist.init_process_group first")  # fmt: skip
    group = group if group is not None else dist.group.WORLD
    require(dist.get_rank(group) >= 0, op, "this process is not a member of `group`")
    backend = backend_of(group)
    if device.type == "cuda":
        require("nccl" in backend or "gloo" in backend, op,
                f"CUDA tensors need an NCCL (or gloo) process group, got '{backend}'")  # fmt: skip
        if "nccl" not in backend:
            _say_gloo_is_slow(group.group_name)
    else:
        require("gloo" in backend, op, f"CPU tensors need a gloo process group, got '{backend}'")
    return group


def is_nccl(group: dist.ProcessGroup) -> bool:
    return "nccl" in backend_of(group)


@functools.cache
def _say_gloo_is_slow(group_name: str) -> None:
    """Once per group: gloo serves CUDA tensors (as for several ranks on one
    GPU, where NCCL refuses) through host copies, correct but slow."""
    _log.warning(
        "overlap_kernels: group '%s' is a gloo group with CUDA tensors: the plain paths' collectives "
        "run through gloo (correct, slow); use an NCCL group for speed",
        group_name,
    )


def check_matrix(op: str, name: str, t: object, device: torch.device | None = None) -> None:
    require(
        isinstance(t, torch.Tensor), op, f"{name} must be a torch.Tensor, got {type(t).__name__}"
    )
    require(t.dim() == 2, op, f"{name} must be 2-D, got shape {tuple(t.shape)}")
    require(t.dtype in SUPPORTED_DTYPES, op,
            f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32")  # fmt: skip
    require(device is None or t.device == device, op, f"{name} is on {t.device}, expected {device}")
    require(
        t.device.type in ("cuda", "cpu"), op, f"{name} is on {t.device}: CUDA or CPU tensors only"
    )


def is_row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) == t.shape[1] or t.numel() == 0


def weight_layout_ok(w: torch.Tensor) -> bool:
    """w [K, N] row-major, or the transpose of a row-major [N, K] (nn.Linear's weight.t())."""
    return is_row_major(w) or is_row_major(w.t())


def check_gemm_operands(op: str, a: object, b: object, a_name: str, b_name: str) -> None:
    """``a`` [M, K] row-major and ``b`` [K, N] in a layout the GEMM core reads."""
    check_matrix(op, a_name, a)
    check_matrix(op, b_name, b, a.device)
    require(
        b.dtype == a.dtype, op, f"{a_name} is {a.dtype} but {b_name} is {b.dtype}; cast one of them"
    )
    require(a.shape[1] == b.shape[0], op,
            f"{a_name} is [M, K] = {tuple(a.shape)} but {b_name} is {tuple(b.shape)}, expected [K={a.shape[1]}, N]")  # fmt: skip
    require(
        is_row_major(a), op, f"{a_name} must be contiguous (row-major): pass {a_name}.contiguous()"
    )
    require(weight_layout_ok(b), op,
            f"{b_name} must be row-major [K, N] or weight.t() of a row-major [N, K]; pass {b_name}.contiguous()")  # fmt: skip


def check_out(
    op: str, out: torch.Tensor | None, shape: tuple[int, int], like: torch.Tensor, *inputs
) -> None:
    """``out`` (when given): ``shape``, ``like``'s dtype and device, row-major, its
    bytes apart from each of ``inputs``'. Every call with an ``out`` makes it, so
    its messages are built only for a refusal: building them costs several times
    the check itself (bench/experiments/probe_plain_host.py)."""
    if out is None:
        return
    if not (
        isinstance(out, torch.Tensor)
        and out.shape == shape
        and out.dtype == like.dtype
        and out.device == like.device
        and (out.stride() == (shape[1], 1) or is_row_major(out))
    ):
        _refuse_out(op, out, shape, like)
    start, size = out.data_ptr(), out.nbytes
    for t in inputs:
        begin, span = t.data_ptr(), t.nbytes  # (an empty out or input overlaps nothing)
        if size and span and start < begin + span and begin < start + size:
            raise OverlapInputError(f"{op}: out overlaps an input; pass a separate tensor")


def _refuse_out(op: str, out: object, shape: tuple[int, int], like: torch.Tensor) -> None:
    """:func:`check_out`'s refusal of an ``out`` of the wrong kind, shape, dtype, device or layout."""
    require(isinstance(out, torch.Tensor), op, "out must be a torch.Tensor")
    require(tuple(out.shape) == shape, op, f"out has shape {tuple(out.shape)}, expected {shape}")
    require(out.dtype == like.dtype, op, f"out has dtype {out.dtype}, expected {like.dtype}")
    require(out.device == like.device, op, f"out is on {out.device}, expected {like.device}")
    require(is_row_major(out), op, "out must be contiguous (row-major)")


TMA_ALIGN = 16  # bytes: TMA reads rows whose stride and base are 16-byte aligned


def tma_layout_blocker(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why the GEMM core's TMA loads cannot read ``a @ b`` (None when they can).

    Shapes and layouts only (never addresses, which differ between ranks);
    a misaligned base is fixed by :func:`tma_aligned` instead."""
    row_bytes = a.shape[1] * a.element_size()
    if row_bytes % TMA_ALIGN:
        return f"K * itemsize = {row_bytes} bytes is not a multiple of {TMA_ALIGN} (TMA)"
    b_rows = b if is_row_major(b) else b.t()
    b_row_bytes = b_rows.shape[1] * b.element_size()
    if b_row_bytes % TMA_ALIGN:
        return f"w's rows are {b_row_bytes} bytes, not a multiple of {TMA_ALIGN} (TMA)"
    return None


def new_out(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """A row-major [rows, cols] tensor of ``like``'s dtype and device: torch.empty_strided,
    which takes 30% less host time than torch.empty (bench/experiments/probe_host_layers.py),
    and at decode sizes a call's host time is its time."""
    return torch.empty_strided(shape, (shape[1], 1), dtype=like.dtype, device=like.device)


def tma_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when TMA can read it from its base address, else an aligned copy
    with the same layout (a view at an odd offset into a larger tensor, say)."""
    return t if t.data_ptr() % TMA_ALIGN == 0 else t.clone()


@dataclass(frozen=True)
class GemmKnobs:
    """The GEMM core's knobs, the first fields of every op's config (each op's
    template explains the values it uses)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8  # M-blocks that share one sweep over N (L2 reuse)
    num_warps: int = 8
    num_stages: int = 3  # K-loop pipeline depth
    loads: str = (
        "tma"  # or "pointer": operands read by masked loads (kernels/gemm.py: tile_product)
    )
    # Other values of some TILE_FIELDS (a dict, or a template's inline table) that the matmul
    # core takes where their tiles fill its persistent grid's last wave fuller (ops/matmul.py)
    wave_fill_tiles: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        # kept as sorted (field, value) pairs: a config is a cache key, and a dict cannot be one
        if isinstance(self.wave_fill_tiles, dict):
            pairs = tuple(sorted(self.wave_fill_tiles.items()))
            object.__setattr__(self, "wave_fill_tiles", pairs)


# The fields that make a GEMM core's tiles: what ``wave_fill_tiles`` may set.
TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m")


def with_wave_fill_tiles(cfg: GemmKnobs) -> GemmKnobs:
    """``cfg`` with its ``wave_fill_tiles`` in place of its own tiles (and none left to choose)."""
    return dataclasses.replace(cfg, wave_fill_tiles=(), **dict(cfg.wave_fill_tiles))


def check_gemm_knobs(op: str, cfg: AgGemmConfig | GemmRsConfig | GemmArConfig) -> None:
    """The GEMM core's knobs every op config has (tiles, warps, stages, pieces, timeout)."""
    check_tile_knobs(op, cfg)
    check_wave_fill_tiles(op, cfg)
    require(
        cfg.loads in LOADS, op, f"config: loads must be {' or '.join(LOADS)}, got '{cfg.loads}'"
    )
    require(cfg.pieces >= 1, op, f"config: pieces must be >= 1, got {cfg.pieces}")
    require(cfg.timeout_s > 0, op, f"config: timeout_s must be > 0, got {cfg.timeout_s}")


def check_tile_knobs(op: str, cfg: GemmKnobs | MoeConfig) -> None:
    """Tile sizes, tile order (group_m), warps and stages."""
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(cfg, name)
        require(
            value >= 16 and value & (value - 1) == 0,
            op,
            f"config: {name} must be a power of two >= 16, got {value}",
        )
    require(
        cfg.num_warps in (1, 2, 4, 8, 16),
        op,
        f"config: num_warps must be 1, 2, 4, 8 or 16, got {cfg.num_warps}",
    )
    require(cfg.num_stages >= 1, op, f"config: num_stages must be >= 1, got {cfg.num_stages}")
    require(cfg.group_m >= 1, op, f"config: group_m must be >= 1, got {cfg.group_m}")


def check_wave_fill_tiles(op: str, cfg: AgGemmConfig | GemmRsConfig | GemmArConfig) -> None:
    """``wave_fill_tiles`` names tile fields only, with values the tile checks take, and
    only in ag_gemm's config, whose template sets it at world 1: there the matmul core alone
    reads it (on one rank ag_gemm is torch.mm: ops/paths.LocalGemm); its fused GEMM over
    several ranks does not. gemm_rs and gemm_ar refuse it rather than ignore it."""
    if not cfg.wave_fill_tiles:
        return
    require(
        op == "ag_gemm", op, "config: wave_fill_tiles is read by matmul alone (ag_gemm's config)"
    )
    fields = [name for name, _ in cfg.wave_fill_tiles]
    unknown = sorted(set(fields) - set(TILE_FIELDS))
    require(not unknown, op,
            f"config: wave_fill_tiles may set {', '.join(TILE_FIELDS)}, got {', '.join(unknown)}")  # fmt: skip
    check_tile_knobs(op, with_wave_fill_tiles(cfg))


# Shared memory one block may use on H100/H200 (227 KiB).
SHARED_MEMORY_BYTES = 232448


def check_tiles_fit(
    op: str,
    cfg: GemmKnobs | MoeConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    store_buffer: bool = False,
) -> None:
    """The K loop's staged tiles, num_stages x (block_m + block_n) x block_k
    elements, must fit in shared memory (checked on CUDA: the interpreter has
    no limit). 128x256x64 bf16 at 3 stages is 147,456 bytes (the compiled
    kernel reports 147,480); fp32 needs block_k 32. ``store_buffer``: the
    kernel also keeps a block_m x block_n output tile for its asynchronous TMA
    stores (the chunked and the grouped GEMM's "tma" epilogue: 212,992 bytes at
    128x256x64 bf16, 3 stages; the compiled chunked GEMM reports 213,016)."""
    if device.type != "cuda":
        return
    staged = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * dtype.itemsize
    stored = cfg.block_m * cfg.block_n * dtype.itemsize if store_buffer else 0
    require(staged + stored <= SHARED_MEMORY_BYTES, op,
            f"config: {cfg.num_stages} stages of {cfg.block_m}x{cfg.block_k} + {cfg.block_k}x{cfg.block_n} "
            f"{str(dtype).removeprefix('torch.')} tiles"
            f"{f' and a {cfg.block_m}x{cfg.block_n} tile for TMA stores' if stored else ''} need "
            f"{staged + stored} bytes of shared memory, more than {SHARED_MEMORY_BYTES}: lower num_stages, "
            f"block_k or the block sizes{', or use epilogue pointer' if stored else ''}")  # fmt: skip


# What records gradients for each op (integrations/): the ops here record none.
_MOE_CHAIN = (
    "overlap_kernels.integrations.functional.moe_dispatch, your experts, then "
    "overlap_kernels.integrations.functional.moe_combine"
)
_DIFFERENTIABLE = {
    "ag_gemm": "overlap_kernels.integrations.functional.linear_ag or torch.ops.overlap_kernels.ag_gemm",
    "gemm_rs": "overlap_kernels.integrations.functional.linear_rs or torch.ops.overlap_kernels.gemm_rs",
    "gemm_ar": "overlap_kernels.integrations.functional.linear_ar or torch.ops.overlap_kernels.gemm_ar",
    "matmul": "torch.matmul",
    "moe_dispatch": "overlap_kernels.integrations.functional.moe_dispatch or torch.ops.overlap_kernels.moe_dispatch",
    "moe_combine": "overlap_kernels.integrations.functional.moe_combine (with functional.moe_dispatch's handle)",
    "moe_dispatch_gemm": _MOE_CHAIN,
    "moe_gemm_combine": _MOE_CHAIN,
    "moe_mlp": _MOE_CHAIN,
    "all_reduce": "torch.distributed.all_reduce",
    "all_reduce_rmsnorm": "torch.distributed.all_reduce, then torch.nn.functional.rms_norm",
    "gemm_ar_rmsnorm": "overlap_kernels.integrations.functional.linear_ar, then torch.nn.functional.rms_norm",
    # The graph mode is for inference: the differentiable pair sizes its outputs on the host.
    "moe_dispatch_graph": "overlap_kernels.integrations.functional.moe_dispatch",
    "moe_combine_graph": "overlap_kernels.integrations.functional.moe_combine",
}


def refuse_grad(op: str, *operands: object) -> None:
    """Refuse operands that require grad while grad mode is on: the op would
    return a result autograd cannot trace back (every call; a few attribute reads).
    Called first, before a plan, an agreement or a workspace epoch: a refused
    call leaves nothing behind. (Inside a custom op's kernel grad mode is off:
    the differentiable forms in integrations/ pass through.)"""
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in operands):
        raise OverlapInputError(
            f"{op}: an operand requires grad, and {op} records no gradient: use {_DIFFERENTIABLE[op]}, "
            "which are differentiable, or call it under torch.no_grad()"
        )


def check_current_device(op: str, t: torch.Tensor) -> None:
    device = t.device
    if device.type == "cuda":
        check_current_cuda(op, device)


def check_current_cuda(op: str, device: torch.device) -> None:
    """CUDA ``device`` (the inputs') must be the current device (every call: no message built unless raised)."""
    current = torch._C._cuda_getDevice()  # (CUDA is up: the inputs are on it; no lazy-init check)
    if device.index != current:
        raise OverlapInputError(f"{op}: inputs are on {device} but the current device is cuda:{current}; "
                                "call torch.cuda.set_device")  # fmt: skip


EPILOGUES = ("pointer", "tma")
LOADS = ("tma", "pointer")


def check_epilogue(op: str, cfg: AgGemmConfig | GemmRsConfig | GemmArConfig | MoeConfig) -> None:
    require(
        cfg.epilogue in EPILOGUES,
        op,
        f"config: epilogue must be pointer or tma, got '{cfg.epilogue}'",
    )


def resolve_epilogue(
    op: str, cfg: AgGemmConfig | GemmRsConfig | GemmArConfig, out: torch.Tensor, n: int
) -> AgGemmConfig | GemmRsConfig | GemmArConfig:
    """The config with the epilogue this call can use. ``epilogue="tma"``
    stores rows of N elements through TMA descriptors, which need 16-byte
    aligned rows and bases; where ``out`` or N does not allow that, the tiles
    go through the pointer epilogue instead (same results, slower stores)."""
    if cfg.epilogue != "tma":
        return cfg
    aligned = (n * out.element_size()) % TMA_ALIGN == 0 and out.data_ptr() % TMA_ALIGN == 0 and \
        out.stride(0) * out.element_size() % TMA_ALIGN == 0  # fmt: skip
    if aligned:
        return cfg
    _log.info("%s: epilogue 'pointer' (out or N=%d is not 16-byte aligned for TMA stores)", op, n)
    return dataclasses.replace(cfg, epilogue="pointer")


def epilogue_for_new_out(
    op: str, cfg: AgGemmConfig | GemmRsConfig | GemmArConfig, n: int, dtype: torch.dtype
) -> AgGemmConfig | GemmRsConfig | GemmArConfig:
    """:func:`resolve_epilogue` for an ``out`` the op allocates (contiguous, aligned base)."""
    return resolve_epilogue(op, cfg, torch.empty((0, n), dtype=dtype, device="meta"), n)


def config_key(config: GemmKnobs | MoeConfig | dict) -> Hashable | None:
    """``config`` as part of a cache key (a dict as its sorted items); None when
    it cannot be one (a value that is not hashable)."""
    key = tuple(sorted(config.items())) if isinstance(config, dict) else config
    try:
        hash(key)
    except TypeError:
        return None
    return key
