"""Hugging Face transformers' tensor parallelism with our style
(integrations/transformers.py): the registry, then a tiny random Llama loaded
with transformers' own TP entry (``from_pretrained(distributed_config=...)``)
on 2 ranks, our ``"ok_rowwise"`` plan against the stock plan, the
single-process model and its float64 copy: logits (inference) and every
parameter's gradient (training), with a count of the gemm_ar calls."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank

from overlap_kernels.launch import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # from_pretrained's TP entry asks for it (transformers[torch])

LAYERS = 2
# (o_proj and down_proj: the plan's two row-wise linears per decoder layer)
OUR_OVERRIDE = {
    "model.layers.*.self_attn.o_proj": "ok_rowwise",
    "model.layers.*.mlp.down_proj": "ok_rowwise",
}
# reference.py's floors: fp32 and bf16 relative errors below which both are rounding-level
_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-4}


def test_register_styles_is_idempotent_and_lazy():
    # Importing the module does not import transformers (a fresh interpreter).
    code = (
        "import sys, overlap_kernels.integrations.transformers as t; "
        "assert 'transformers' not in sys.modules, 'imported transformers'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)

    from transformers import LlamaConfig
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import RowwiseParallel

    from overlap_kernels.integrations.transformers import overlap_tp_plan, register_styles

    assert register_styles() == ("ok_rowwise",)
    style = ALL_PARALLEL_STYLES["ok_rowwise"]
    assert register_styles() == ("ok_rowwise",) and ALL_PARALLEL_STYLES["ok_rowwise"] is style
    assert isinstance(style, RowwiseParallel) and type(style) is not RowwiseParallel
    stock = LlamaConfig.base_model_tp_plan
    ours = overlap_tp_plan(stock)
    assert ours.keys() == stock.keys() and stock["layers.*.mlp.down_proj"] == "rowwise"
    assert {k: v for k, v in ours.items() if v != stock[k]} == {
        k: "ok_rowwise" for k, v in stock.items() if v == "rowwise"
    }
    # A name another library took is refused, not overwritten.
    mapping = type(ALL_PARALLEL_STYLES)._global_mapping
    try:
        mapping["ok_rowwise"] = RowwiseParallel()
        with pytest.raises(ValueError, match="already maps 'ok_rowwise'"):
            register_styles()
    finally:
        mapping["ok_rowwise"] = style


def _config():
    from transformers import LlamaConfig

    # head_dim 16, 2 KV heads: each of 2 ranks holds 2 query heads, 1 KV head.
    # initializer_range 0.1 (not 0.02): activations far enough from 0 that
    # attention and SiLU are not near-linear. Biases on: the row-wise bias is
    # added once, after the reduction, and its gradient is every rank's.
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       initializer_range=0.1, attention_bias=True, mlp_bias=True)  # fmt: skip


def _check(what, ours, stock, plain, ref, dtype):
    """``ours`` (TP, our style) against ``ref`` (the float64 single-process
    model), as accurate as the two other models in ``dtype``: ``stock`` (TP,
    transformers' styles) and ``plain`` (single process). Each differs from
    ``ref`` only by rounding, in its own summation order, so ours may err at
    most twice the worse of theirs (quack's criterion) plus the rounding-level
    floor, in the norm and at the worst element. A missing reduction, a wrong
    shard or a doubled bias is O(|ref|), orders above either."""
    ref = ref.double().cpu()

    def err(t):
        return (t.detach().double().cpu() - ref).abs()

    def rel(e):
        return (e.norm() / ref.norm().clamp_min(1e-300)).item()

    mine, theirs = err(ours), [err(stock), err(plain)]
    allowed_rel = 2 * max(rel(e) for e in theirs) + _FLOOR[dtype]
    allowed_max = 2 * max(e.max().item() for e in theirs) + _FLOOR[dtype] * ref.abs().max().item()
    assert rel(mine) <= allowed_rel, f"{what}: relative error {rel(mine):.3g} > {allowed_rel:.3g}"
    assert mine.max().item() <= allowed_max, (
        f"{what}: worst element off by {mine.max().item():.3g} > {allowed_max:.3g}"
    )
    return rel(mine), allowed_rel


def _row_parallel(x, w, b, world):
    """x @ w.T + b as a row-parallel linear rounds it, for the stock path's accuracy:
    each rank's product of its slice of the input features rounded to the dtype,
    the partials summed in the dtype (the all-reduce), then the bias. Its error is
    a few roundings of a partial, above a single-process linear's one rounding."""
    partials = [
        torch.nn.functional.linear(xs, ws)
        for xs, ws in zip(x.chunk(world, dim=-1), w.chunk(world, dim=1), strict=True)
    ]
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return total + b


def llama_tp_body(rank, world, use_gpu, path, dtype_name, train):
    """Rank 0 saves a fresh random tiny Llama, its input ids and an output
    gradient to ``path``; every rank loads the model five ways: single process
    (``plain``), float64 on the CPU (``ref``), TP with the stock plan, TP with
    ours (the override in DistributedConfig, and overlap_tp_plan on the config:
    the two switches). ``train``: logits and every parameter's gradient under
    autograd, else logits under no_grad, plus our style's fallback."""
    import functools
    import os

    from torch.distributed.tensor import DTensor, Replicate
    from transformers import AutoConfig, DistributedConfig, LlamaForCausalLM

    import overlap_kernels.integrations.functional as functional
    from overlap_kernels.integrations.transformers import overlap_tp_plan, register_styles
    from overlap_kernels.ops import plans

    dist, device = setup_rank(rank, use_gpu)
    dtype = getattr(torch, dtype_name)
    if use_gpu:  # from_pretrained's TP binds each rank to the GPU LOCAL_RANK names
        os.environ["LOCAL_RANK"] = str(device.index)
    if rank == 0:  # the seed is fresh: a new model and input every run
        model = LlamaForCausalLM(_config())
        with torch.no_grad():  # (transformers initializes biases to 0 and norms to 1)
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(torch.randn_like(p), alpha=0.1)
        model.save_pretrained(path)
        tokens = 8 * world
        torch.save({"ids": torch.randint(0, 128, (2, tokens)),
                    "g": torch.randn(2, tokens, 128, dtype=torch.float64)}, f"{path}/inputs.pt")  # fmt: skip
    dist.barrier()
    inputs = torch.load(f"{path}/inputs.pt")
    ids, g = inputs["ids"], inputs["g"]

    calls = []
    real = functional.linear_ar
    functional.linear_ar = lambda *a, **k: calls.append(1) or real(*a, **k)
    register_styles()
    switched = AutoConfig.from_pretrained(path)
    switched.base_model_tp_plan = overlap_tp_plan(switched.base_model_tp_plan)
    loads = {
        "plain": {},
        "ref": {"dtype": torch.float64},
        "stock": {"distributed_config": DistributedConfig(tp_size=world)},
        "ours": {"distributed_config": DistributedConfig(tp_size=world, tp_plan=OUR_OVERRIDE)},
        "ours_config": {"config": switched, "distributed_config": DistributedConfig(tp_size=world)},
    }
    logits, grads, made = {}, {}, {}
    for name, kwargs in loads.items():
        kwargs.setdefault("dtype", dtype)
        model = LlamaForCausalLM.from_pretrained(path, **kwargs)
        if name == "ref":
            model = model.cpu()
        elif name == "plain":
            model = model.to(device)
        model.train(train)
        before, made_before = len(calls), plans.made["gemm_ar"]
        with torch.set_grad_enabled(train):
            out = model(ids.to(model.device)).logits
            if train:
                out.backward(g.to(out.device, out.dtype))
        made[name] = (len(calls) - before, plans.made["gemm_ar"] - made_before)
        logits[name] = out.detach()
        if train:
            grads[name] = {
                n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                for n, p in model.named_parameters()
            }
        if name == "ours" and not train:
            # Fallback: a replicated DTensor input (not our layout) runs the
            # stock forward, which redistributes it.
            proj = model.model.layers[0].self_attn.o_proj
            assert isinstance(proj.forward, functools.partial), "ok_rowwise installed no forward"
            x = torch.randn(2, 3, proj.in_features, device=model.device, dtype=dtype)
            dist.broadcast(x, 0)
            before = len(calls)
            with torch.no_grad():
                y = proj(DTensor.from_local(x, proj.weight.device_mesh, [Replicate()]))
            assert len(calls) == before, "the fallback ran our op"
            # the whole x times the whole weight, plus the bias
            w, b = proj.weight.full_tensor(), proj.bias.full_tensor()
            y = y.full_tensor() if isinstance(y, DTensor) else y
            plain = torch.nn.functional.linear(x, w, b)
            ref = x.double() @ w.double().t() + b.double()
            _check("fallback", y, _row_parallel(x, w, b, world), plain, ref, dtype)

    # Our op ran: one gemm_ar per row-wise linear, two signatures (o_proj's
    # and down_proj's K) planned by the first of our models (the second plans
    # again only where its mesh has new groups); none in the others.
    assert made["ours"] == (2 * LAYERS, 2), made
    assert made["ours_config"][0] == 2 * LAYERS and made["ours_config"][1] in (0, 2), made
    assert all(made[name] == (0, 0) for name in ("plain", "ref", "stock")), made
    checks = {}
    for name in ("ours", "ours_config"):
        checks[f"{name} logits"] = _check(f"{name} logits", logits[name], logits["stock"],
                                          logits["plain"], logits["ref"], dtype)  # fmt: skip
        for param in grads.get(name, {}):
            checks[f"{name} d{param}"] = _check(
                f"{name} d{param}", grads[name][param], grads["stock"][param],
                grads["plain"][param], grads["ref"][param], dtype,
            )  # fmt: skip
    if train:
        assert len(grads["ours"]) == len(grads["ref"]) == len(checks) // 2 - 1, sorted(checks)
    return True


@pytest.mark.parametrize("train", [False, True], ids=["logits", "gradients"])
def test_llama_tp_with_our_style_cpu(tmp_path, train):
    results = run_ranks(llama_tp_body, 2, False, str(tmp_path), "float32", train, timeout_s=600)
    assert results == [True, True]


@gpu_ranks(worlds=(2,), backends=("torch",))
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_llama_tp_with_our_style_gpu(tmp_path, world, gpus, backend, dtype_name):
    for train in (False, True):
        assert (
            run_on_gpus(
                llama_tp_body, world, gpus, backend, str(tmp_path), dtype_name, train, timeout_s=600
            )
            == [True] * world
        ), train
