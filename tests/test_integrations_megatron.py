"""The Megatron-core integration (integrations/megatron.py) on 2 gloo CPU ranks,
fp32, ``use_cpu_initialization=True``: our column/row linears against
Megatron's own and the float64 oracles, ``main_grad`` accumulation, a TP=2
GPT transformer layer built from our spec against the stock local spec, and
the spec rewrite. Skipped where megatron-core is not installed
(``pip install 'overlap_kernels[megatron]'``).

Megatron's own sequence-parallel linears cannot run on CPU (their backward
allocates on ``torch.cuda.current_device()``), so ours with sequence
parallelism are compared with Megatron's without: the same product, the
output re-sharded by sequence rows. Three documented workarounds let Megatron
run on CPU at all (``_megatron_rank``): the RNG tracker's inference variant
(its ``fork()`` is a no-op; every dropout here is 0), a CPU tensor placed in
Megatron's global memory buffer (the local attention takes its score buffer
from it), and an explicit causal mask (the default one is made on CUDA).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from logging.handlers import BufferingHandler

import pytest
import torch
from ranks import OurOpCalls, gpu_ranks, run_on_gpus, setup_rank
from test_gemm_rs_ar import _rows, check_sum
from test_integrations import _bias_grad_ok

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import check_matmul, relative_error

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra [megatron])")


# ---- per-rank setup ----------------------------------------------------------------


def _megatron_rank(rank, world, use_gpu):
    """(dist, device, a generator seeded alike on every rank) after Megatron's
    model-parallel setup with TP = world; on CPU with the workarounds of the
    module docstring."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    dist, device = setup_rank(rank, use_gpu)
    seed = torch.randint(2**31, (1,), device=device)  # fresh every run, rank 0's for all
    dist.broadcast(seed, src=0)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=world, create_gloo_process_groups=False
    )
    if use_gpu:
        megatron_random.model_parallel_cuda_manual_seed(int(seed))
    else:
        megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        buffers = parallel_state.get_global_memory_buffer().buffer
        for dtype in (torch.float32, torch.float64):  # get_tensor reuses a big enough one
            buffers[("mpu", dtype)] = torch.empty(1 << 14, dtype=dtype)
    return dist, device, torch.Generator().manual_seed(int(seed))


def _randn(generator, *shape, device, scale=1.0):
    return (scale * torch.randn(*shape, generator=generator)).to(device)


def _twin(stock, ours, device, generator=None):
    """``ours`` gets ``stock``'s parameters (the state_dict keys must match);
    biases (Megatron zeroes them) are made random first: the replicated ones
    alike on every rank (``generator``), the sharded ones per rank."""
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if name.endswith("bias"):
                sharded = getattr(p, "tensor_model_parallel", False)
                p.copy_(torch.randn(p.shape, generator=None if sharded else generator))
    ours.load_state_dict(stock.state_dict())
    return stock.to(device), ours.to(device)


def _two_d(t):
    return t.reshape(-1, t.shape[-1])


# ---- (a) the linears against Megatron's own and float64 ---------------------------


def _config(world, sequence_parallel, **kw):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=world,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **kw,
    )


def _init(weight):
    return torch.nn.init.normal_(weight)


def linears_body(rank, world, use_gpu):
    """Column and row linears, ours and Megatron's, same weights, forward and
    backward, each judged against float64 (reference.check_matmul; check_sum
    for sums over ranks): output, input gradient, weight and bias gradients.
    Sequence parallelism off: the column is Megatron's own path (bitwise the
    same), the row runs gemm_ar. On: ours against Megatron's with it off, our
    output and input gradient being this rank's sequence rows of theirs. Then
    skip_bias_add and a frozen weight, sequence parallel on."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from overlap_kernels.integrations.megatron import (
        OverlapColumnParallelLinear,
        OverlapRowParallelLinear,
    )

    dist, device, shared = _megatron_rank(rank, world, use_gpu)
    s, b, h, n = 4 * world, 2, 32, 24 * world  # [s, b, h] in; n sharded over the ranks
    seq = _rows(rank, s, world)  # this rank's sequence positions with SP
    rows = _rows(rank, s * b, world)  # the same as rows of the [s * b, .] views
    column = {"input_size": h, "output_size": n, "gather_output": False}
    row = {"input_size": n, "output_size": h, "input_is_parallel": True, "skip_bias_add": False}
    for kw in (column, row):
        kw.update(init_method=_init, bias=True)
    checked = []

    def run(layer, x, g, ops=None):
        x = x.clone().requires_grad_()
        with OurOpCalls() as watch:
            y, bias_out = layer(x)
            y.backward(g)
        assert bias_out is None
        if ops is not None:
            assert dict(watch.calls) == ops, (type(layer).__name__, dict(watch.calls))
        return y.detach(), x.grad

    # Column-parallel: x [s, b, h] replicated (SP off) or sequence-sharded (on).
    x_full = _randn(shared, s, b, h, device=device)
    g = torch.randn(s, b, n // world, device=device)  # this rank's output features' gradient
    for sp in (False, True):
        stock = ColumnParallelLinear(**column, config=_config(world, False))
        ours = OverlapColumnParallelLinear(**column, config=_config(world, sp))
        stock, ours = _twin(stock, ours, device)
        # (x kept alone, as Megatron keeps it: gathered again for dW beside dgrad)
        fused = {"ag_gemm": 1, "ag_gemm_regathered_grads": 1} if sp else {}
        results = {"megatron": run(stock, x_full, g, {}),
                   "ours": run(ours, x_full[seq] if sp else x_full, g, fused)}  # fmt: skip
        if not sp:  # Megatron's own path in both
            assert all(torch.equal(a, b_) for a, b_ in zip(results["ours"], results["megatron"]))
            assert torch.equal(ours.weight.grad, stock.weight.grad)
            assert torch.equal(ours.bias.grad, stock.bias.grad)
        for who, layer in (("megatron", stock), ("ours", ours)):
            what = f"column sp={sp} {who}"
            y, dx = results[who]
            weight = layer.weight.detach()
            check_matmul(_two_d(y - layer.bias.detach()), _two_d(x_full), weight.t(), what)
            mine = rows if (sp and who == "ours") else slice(None)
            check_sum(dist, _two_d(dx), _two_d(g), weight, mine, what=f"{what} dx")
            check_matmul(layer.weight.grad, _two_d(g).t(), _two_d(x_full), f"{what} dweight")
            assert _bias_grad_ok(layer.bias.grad, _two_d(g)), f"{what} dbias"
            checked.append(what)

    # Row-parallel: x [s, b, n_local] this rank's features; the output
    # replicated (SP off: its gradient too) or sequence-sharded (on).
    x = torch.randn(s, b, n // world, device=device)
    g_full = _randn(shared, s, b, h, device=device)
    for sp in (False, True):
        stock = RowParallelLinear(**row, config=_config(world, False))
        ours = OverlapRowParallelLinear(**row, config=_config(world, sp))
        stock, ours = _twin(stock, ours, device, shared)
        fused = {"gemm_rs": 1, "ag_gemm": 1} if sp else {"gemm_ar": 1}
        results = {"megatron": run(stock, x, g_full, {}),
                   "ours": run(ours, x, g_full[seq] if sp else g_full, fused)}  # fmt: skip
        for who, layer in (("megatron", stock), ("ours", ours)):
            what = f"row sp={sp} {who}"
            y, dx = results[who]
            weight, sharded = layer.weight.detach(), sp and who == "ours"
            mine = rows if sharded else slice(None)
            check_sum(dist, _two_d(y - layer.bias.detach()), _two_d(x), weight.t(), mine, what=what)
            check_matmul(_two_d(dx), _two_d(g_full), weight, f"{what} dx")
            check_matmul(layer.weight.grad, _two_d(g_full).t(), _two_d(x), f"{what} dweight")
            bias_grad = layer.bias.grad.clone()
            if sharded:  # this rank's tokens' sum, all-reduced by Megatron's finalize_model_grads
                assert layer.bias.sequence_parallel
                dist.all_reduce(bias_grad)
            assert _bias_grad_ok(bias_grad, _two_d(g_full)), f"{what} dbias"
            checked.append(what)

    # What ours does not serve runs Megatron's own path, with one log line: here
    # a row input not yet split over the ranks (Megatron scatters it).
    kept = BufferingHandler(capacity=100)
    log = logging.getLogger("overlap_kernels.integrations.megatron")
    log.setLevel(logging.INFO)
    log.addHandler(kept)
    unsplit = {**row, "input_is_parallel": False}
    stock = RowParallelLinear(**unsplit, config=_config(world, False))
    ours = OverlapRowParallelLinear(**unsplit, config=_config(world, False))
    stock, ours = _twin(stock, ours, device, shared)
    x_unsplit = _randn(shared, s, b, n, device=device)
    with torch.no_grad(), OurOpCalls() as watch:  # (its backward allocates on CUDA: forward only)
        outputs = [layer(x_unsplit)[0] for layer in (ours, stock, ours)]  # (logged once)
    assert not watch.calls and torch.equal(outputs[0], outputs[1])
    assert [r.getMessage() for r in kept.buffer] == [
        "OverlapRowParallelLinear: an input not split over the ranks (input_is_parallel=False), "
        "so Megatron's own path runs"
    ]

    # skip_bias_add: the bias comes back, unadded; a frozen weight: no weight gradient.
    ours = OverlapColumnParallelLinear(**column, skip_bias_add=True, config=_config(world, True))
    y, bias_out = ours.to(device)(x_full[seq])
    assert bias_out is ours.bias
    check_matmul(
        _two_d(y.detach()), _two_d(x_full), ours.weight.detach().t(), "column skip_bias_add"
    )
    ours = OverlapRowParallelLinear(**{**row, "skip_bias_add": True}, config=_config(world, True))
    y, bias_out = ours.to(device)(x)
    assert bias_out is ours.bias
    weight = ours.weight.detach()
    check_sum(dist, _two_d(y.detach()), _two_d(x), weight.t(), rows, what="row skip_bias_add")
    for cls, kw, x_in, g_in in ((OverlapColumnParallelLinear, column, x_full[seq], g),
                                (OverlapRowParallelLinear, row, x, g_full[seq])):  # fmt: skip
        layer = cls(**kw, config=_config(world, True)).to(device)
        layer.weight.requires_grad_(False)
        _, dx = run(layer, x_in, g_in, {"ag_gemm": 1, "gemm_rs": 1})  # (no x gathered for dW)
        weight = layer.weight
        if cls is OverlapColumnParallelLinear:
            check_sum(dist, _two_d(dx), _two_d(g), weight, rows, what="column frozen dx")
        else:
            check_matmul(_two_d(dx), _two_d(g_full), weight, "row frozen dx")
        assert weight.grad is None and layer.bias.grad is not None
    return checked


def test_linears_match_megatron_and_float64_cpu():
    expected = [f"{kind} sp={sp} {who}" for kind in ("column", "row") for sp in (False, True)
                for who in ("megatron", "ours")]  # fmt: skip
    assert run_ranks(linears_body, 2, False, timeout_s=600) == [expected] * 2


def main_grad_body(rank, world, use_gpu):
    """gradient_accumulation_fusion: two micro-batches through our layers
    (sequence parallel on) add each weight gradient to ``main_grad``, set
    ``grad_added_to_main_grad`` and leave Megatron's DDP hook a dummy
    gradient. Expected: main_grad0 + dW1 + dW2 in that order, dW_i from the
    same layer without the fusion (the same ops on the same inputs: bitwise)."""
    import megatron.core.tensor_parallel.layers as megatron_layers

    from overlap_kernels.integrations.megatron import (
        OverlapColumnParallelLinear,
        OverlapRowParallelLinear,
    )

    dist, device, shared = _megatron_rank(rank, world, use_gpu)
    # Megatron's constructor asks for apex's CUDA wgrad kernel, which our path does not use.
    megatron_layers._grad_accum_fusion_available = True
    s, b, h, n = 2 * world, 2, 16, 8 * world
    cases = [  # (layer, its arguments, x's shape, the output's shape)
        (OverlapColumnParallelLinear, {"input_size": h, "output_size": n, "gather_output": False},
         (s // world, b, h), (s, b, n // world)),
        (OverlapRowParallelLinear, {"input_size": n, "output_size": h, "input_is_parallel": True,
                                    "skip_bias_add": False},
         (s, b, n // world), (s // world, b, h)),
    ]  # fmt: skip
    for cls, kw, x_shape, g_shape in cases:
        plain, fused = (cls(**kw, init_method=_init, bias=True,
                            config=_config(world, True, gradient_accumulation_fusion=fusion))
                        for fusion in (False, True))  # fmt: skip
        fused.load_state_dict(plain.state_dict())
        plain, fused = plain.to(device), fused.to(device)
        main_grad = torch.randn(fused.weight.shape, device=device)
        fused.weight.main_grad, fused.weight.grad_added_to_main_grad = main_grad.clone(), False
        for _ in range(2):
            x, g = torch.randn(x_shape, device=device), torch.randn(g_shape, device=device)
            plain.weight.grad = None
            plain(x.clone().requires_grad_())[0].backward(g)
            main_grad += plain.weight.grad
            fused(x.clone().requires_grad_())[0].backward(g)
        assert torch.equal(fused.weight.main_grad, main_grad), cls.__name__
        assert fused.weight.grad_added_to_main_grad is True
        assert fused.weight.grad is not None  # (the dummy that lets Megatron's DDP hook fire)
    return True


def test_main_grad_accumulation_cpu():
    assert run_ranks(main_grad_body, 2, False, timeout_s=600) == [True] * 2


# ---- (b) a GPT transformer layer: our spec against the stock local spec -----------


class _SPLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm under Megatron's norm constructor, with sequence
    parallelism allowed (Megatron's WrappedTorchNorm, the local spec's norm
    without apex, refuses it; apex's and TE's norms take it). It works per
    token, so sharded tokens need nothing; its parameters are marked
    ``sequence_parallel``, as Megatron marks its own norms', so that their
    gradients (this rank's tokens' share) are all-reduced."""

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def _with_norm(spec, norm):
    layer = dataclasses.replace(spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm)
    return dataclasses.replace(spec, submodules=layer)


# fp32 results of a whole layer are judged by their norm against float64: at
# most twice the relative error of Megatron's own fp32 layer (the same
# weights, inputs and gradients) plus reference.py's fp32 floor (1e-6:
# rounding-level results in another summation order). Softmax, LayerNorm and
# GeLU make an elementwise bound meaninglessly loose (reference.judge_moe's
# reasoning); a wrong shard, row or missing partial is O(1).
_FP32_FLOOR = 1e-6


def layer_body(rank, world, use_gpu):
    """A TP GPT layer (attention + MLP, biases on) from our spec, with
    sequence parallelism and without, against the same layer from Megatron's
    local spec (fp32, sequence parallelism off) and its float64 copy: output,
    input gradient and every parameter's gradient, after the all-reduce
    Megatron's finalize_model_grads gives sequence-parallel parameters. Our
    layers' forward and backward run the fused ops of all four linears."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from overlap_kernels.integrations.megatron import get_gpt_layer_overlap_spec

    dist, device, shared = _megatron_rank(rank, world, use_gpu)
    s, b, h = 4 * world, 2, 32
    seq = _rows(rank, s, world)

    def build(spec, sequence_parallel):
        config = TransformerConfig(
            num_layers=1, hidden_size=h, num_attention_heads=2 * world, ffn_hidden_size=2 * h,
            tensor_model_parallel_size=world, sequence_parallel=sequence_parallel,
            use_cpu_initialization=True, params_dtype=torch.float32, add_bias_linear=True,
            hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
            masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        )  # fmt: skip
        return build_module(spec, config=config, layer_number=1)

    layers = {
        "megatron": build(get_gpt_layer_local_spec(), False),
        "float64": build(get_gpt_layer_local_spec(), False).double(),
        "ours, sp off": build(get_gpt_layer_overlap_spec(), False),
        "ours, sp on": build(_with_norm(get_gpt_layer_overlap_spec(), _SPLayerNorm), True),
    }  # fmt: skip

    # Checkpoints: the same state_dict keys and the same sharded tensors (key,
    # global shape, this rank's offset, replica id) as the stock spec's layer.
    def checkpoint_view(layer):
        items = layer.sharded_state_dict(prefix="decoder.layers.0.").items()
        return {k: (v.key, tuple(v.global_shape), tuple(v.global_offset), v.replica_id)
                for k, v in items}  # fmt: skip

    for name in ("ours, sp off", "ours, sp on"):
        assert layers[name].state_dict().keys() == layers["megatron"].state_dict().keys(), name
        assert checkpoint_view(layers[name]) == checkpoint_view(layers["megatron"]), name
    with torch.no_grad():  # random parameters: replicated ones alike on every rank
        for p in layers["megatron"].parameters():
            sharded = getattr(p, "tensor_model_parallel", False)
            scale = p.shape[1] ** -0.5 if p.dim() == 2 else 0.5
            p.copy_(scale * torch.randn(p.shape, generator=None if sharded else shared))
    for name, layer in layers.items():
        if name != "megatron":
            layer.load_state_dict(layers["megatron"].state_dict())
        layer.to(device)

    x_full, g_full = (_randn(shared, s, b, h, device=device) for _ in range(2))
    mask = torch.ones(s, s, device=device).triu(1).bool()[None, None]  # causal, True = masked
    results = {}
    for name, layer in layers.items():
        sharded = name == "ours, sp on"
        dtype = torch.float64 if name == "float64" else torch.float32
        x = (x_full[seq] if sharded else x_full).to(dtype).clone().requires_grad_()
        with OurOpCalls() as watch:
            out, _ = layer(x, attention_mask=mask)
            out.backward((g_full[seq] if sharded else g_full).to(dtype))
        grads = {}
        for param_name, p in layer.named_parameters():
            grad = p.grad.clone()
            if getattr(p, "sequence_parallel", False) and sharded:
                dist.all_reduce(grad)  # (finalize_model_grads' all-reduce of SP parameters)
            grads[param_name] = grad
        results[name] = {"output": out.detach(), "dx": x.grad, **grads}
        wanted = {"ours, sp on": {"ag_gemm": 4, "gemm_rs": 2, "ag_gemm_regathered_grads": 2},
                  "ours, sp off": {"gemm_ar": 2}}.get(name, {})  # fmt: skip
        assert dict(watch.calls) == wanted, (name, dict(watch.calls))

    assert results["megatron"].keys() == results["ours, sp on"].keys()
    errors = {}
    for name in ("ours, sp off", "ours, sp on"):
        for key, value in results[name].items():
            rows = seq if name == "ours, sp on" and key in ("output", "dx") else slice(None)
            reference = results["float64"][key][rows]
            plain = relative_error(results["megatron"][key][rows], reference)
            error = relative_error(value, reference)
            assert error <= 2 * plain + _FP32_FLOOR, (
                f"{name}: {key} relative error {error:.3g}, Megatron's own fp32 {plain:.3g}"
            )
            errors[f"{name}: {key}"] = (error, plain)
    return len(errors)


def test_gpt_layer_from_our_spec_matches_stock_cpu():
    assert run_ranks(layer_body, 2, False, timeout_s=600) == [28, 28]


@gpu_ranks(worlds=(2,), backends=("torch",))
def test_gpt_layer_from_our_spec_matches_stock_gpu(world, gpus, backend):
    assert run_on_gpus(layer_body, world, gpus, backend, timeout_s=600) == [28] * world


# ---- (c) the spec rewrite ------------------------------------------------------------


def _classes(spec, path="") -> dict:
    """Every class in a spec, by its path (ModuleSpec modules, submodule fields,
    partials' keywords)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, type):
        return {path: spec}
    if isinstance(spec, ModuleSpec):
        return {**_classes(spec.module, path), **_classes(spec.submodules, path)}
    if isinstance(spec, functools.partial):
        found = _classes(spec.func, path) if isinstance(spec.func, type) else {}
        for name, value in spec.keywords.items():
            found.update(_classes(value, f"{path}.{name}".lstrip(".")))
        return found
    if dataclasses.is_dataclass(spec):
        found = {}
        for field in dataclasses.fields(spec):
            found.update(_classes(getattr(spec, field.name), f"{path}.{field.name}".lstrip(".")))
        return found
    return {}


def test_swap_linears_replaces_exactly_the_four_linears():
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_mlp_module_spec_for_backend,
    )
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from overlap_kernels.integrations.megatron import (
        OverlapColumnParallelLinear,
        OverlapRowParallelLinear,
        OverlapSpecProvider,
        get_gpt_layer_overlap_spec,
        swap_linears,
    )

    def changes(before, after) -> dict:
        old, new = _classes(before), _classes(after)
        assert old.keys() == new.keys()
        return {path: (old[path], new[path]) for path in old if old[path] is not new[path]}

    column = (ColumnParallelLinear, OverlapColumnParallelLinear)
    row = (RowParallelLinear, OverlapRowParallelLinear)
    stock = get_gpt_layer_local_spec()
    swapped = swap_linears(stock)
    assert changes(stock, swapped) == {
        "self_attention.linear_qkv": column,
        "self_attention.linear_proj": row,
        "mlp.linear_fc1": column,
        "mlp.linear_fc2": row,
    }
    assert changes(get_gpt_layer_local_spec(), stock) == {}  # (the argument is left as it was)
    assert changes(swapped, get_gpt_layer_overlap_spec()) == {}
    # MoE: routed experts keep Megatron's linears (explicit expert communication);
    # the shared experts' MLP is a TP MLP and gets ours.
    moe = get_gpt_layer_local_spec(num_experts=4)
    assert changes(moe, swap_linears(moe)) == {
        "self_attention.linear_qkv": column,
        "self_attention.linear_proj": row,
        "mlp.shared_experts.linear_fc1": column,
        "mlp.shared_experts.linear_fc2": row,
    }
    # megatron-core 0.17+ builds the MLP spec as partial(MLP.as_mlp_submodule, submodules=...).
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    mlp = functools.partial(MLP, submodules=submodules)
    assert changes(mlp, swap_linears(mlp)) == {"submodules.linear_fc1": column,
                                               "submodules.linear_fc2": row}  # fmt: skip
    # The provider, for builders that take a backend.
    provider = OverlapSpecProvider()
    assert provider.column_parallel_linear() is OverlapColumnParallelLinear
    assert provider.row_parallel_linear() is OverlapRowParallelLinear
    assert not provider.fuse_layernorm_and_linear()
    built = _classes(get_mlp_module_spec_for_backend(backend=provider))
    assert (built["linear_fc1"], built["linear_fc2"]) == column[1:] + row[1:]
