"""Every kernel compiles for sm_90 (H100/H200) with the CUDA fast paths, on a machine with no GPU.

The interpreter runs the kernels' logic on CPU but is lenient where the
compiler is not (non-constexpr globals, inline PTX, TMA descriptors, types
of loop-carried values). This test builds the real thing in a subprocess
(TRITON_INTERPRET=0 must be set before the kernels are decorated) with
Triton's own ptxas, and checks the instructions we rely on are there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from overlap_kernels.ops.checks import SHARED_MEMORY_BYTES

_SCRIPT = textwrap.dedent(
    """
    import itertools, os, json, sys
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from overlap_kernels.kernels import (activation, all_reduce, gather_sum, gemm, grouped_gemm, moe_graph,
                                         reduce_gemm, routing, runs, transfer)
    from overlap_kernels.runtime import signals

    target = GPUTarget("cuda", 90, 32)
    report = {}
    # This process builds every PARTS-th kernel from PART on (argv); the others, the rest.
    PART, PARTS = int(sys.argv[1]), int(sys.argv[2])
    calls = itertools.count()

    def build(name, fn, signature, constexprs, aligned=(), **options):
        if next(calls) % PARTS != PART:
            return
        for key in constexprs:
            if isinstance(key, str):  # (a tuple key: a constexpr inside a tuple argument)
                signature[key] = "constexpr"
        # aligned: arguments divisible by 16 (pointers: 16-byte aligned), as Triton specialises
        # them at a launch where they are.
        attrs = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in aligned}
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)
        ptx = kernel.asm["ptx"]
        report[name] = {
            "shared": kernel.metadata.shared,
            "wgmma": ptx.count("wgmma.mma_async"),
            "mma": ptx.count("mma.sync.aligned"),
            "tma": ptx.count("cp.async.bulk.tensor"),
            "acquire": ptx.count("ld.acquire.sys"),
            "globaltimer": ptx.count("%globaltimer"),
            "proxy_fence": ptx.count("fence.proxy.async"),
            "release": sum("atom" in l and ".sys" in l and ".release" in l for l in ptx.splitlines()),
            "fenced_signal": ptx.count("fence.acq_rel.sys") and
                sum("atom" in l and ".sys" in l and ".relaxed.max" in l for l in ptx.splitlines()),
            "barrier": ptx.count("bar.sync"),
            "acq_rel": sum("atom" in l and ".sys" in l and ".acq_rel" in l for l in ptx.splitlines()),
            "tma_store": ptx.count("cp.async.bulk.tensor.2d.global.shared"),
            "bulk_wait": ptx.count("cp.async.bulk.wait_group 0"),
            "vector_loads": sum("ld.global" in l and ".v4." in l for l in ptx.splitlines()),
            "vector_stores": sum("st.global" in l and ".v4." in l for l in ptx.splitlines()),
            "async_copies": ptx.count("cp.async.cg.shared.global"),  # 16-byte copies into shared memory
        }

    # err_addr as i32: what Triton passes for 0 (matmul alone has no error record).
    gemm_sig = {"a_ptr": "*DT", "b_ptr": "*DT", "c_ptr": "*DT", "M": "i32", "N": "i32", "K": "i32",
                "stride_cm": "i32", "mblocks_ptr": "*i32", "num_mblocks": "i32", "group_span": "i32",
                "chunk_flags_ptr": "*i32",
                "epoch": "i32", "err_addr": "i32", "wait_budget": "i64", "tail_first_tile": "i32",
                "tail_pieces": "i32", "tail_partials_ptr": "*fp32", "tail_counters_ptr": "*i32",
                "push_src_ptr": "*DT", "push_bytes": "i32", "peer_table_ptr": "*i32", "push_offset": "i32",
                "rank": "i32", "world": "i32", "push_counter_ptr": "*i32", "push_flag0": "i32",
                "push_flag_stride": "i32", "word": "i32", "half_bytes": "i64"}
    pushed_sig = dict(gemm_sig, peer_table_ptr="*i64", push_offset="i64")
    for dtype in ("bf16", "fp16", "fp32"):
        for b_nk in (True, False):
            sig = {k: v.replace("DT", dtype) for k, v in gemm_sig.items()}
            consts = {"BLOCK_M": 128, "BLOCK_N": 256 if dtype != "fp32" else 128, "BLOCK_K": 64 if dtype != "fp32" else 32,
                      "GROUP_M": 8, "NUM_PROGRAMS": 131, "NUM_STAGES": 3, "B_NK": b_nk,
                      "INPUT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "FAST_SIGNALS": True,
                      "INTERPRETED_BF16": False, "SUM_ROWS": 16, "TMA_EPILOGUE": False,
                      "PUSH_ROWS": False, "PUSH_WORDS": 2048, "POINTER_LOADS": False}
            build(f"gemm_{dtype}_{'nk' if b_nk else 'kn'}", gemm.chunked_gemm_kernel, sig, consts, num_warps=8)
    build("gemm_bf16_nk_tma", gemm.chunked_gemm_kernel, {k: v.replace("DT", "bf16") for k, v in gemm_sig.items()},
          {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "NUM_PROGRAMS": 131, "NUM_STAGES": 3,
           "B_NK": True, "INPUT_PRECISION": "tf32", "FAST_SIGNALS": True, "INTERPRETED_BF16": False,
           "SUM_ROWS": 16, "TMA_EPILOGUE": True, "PUSH_ROWS": False, "PUSH_WORDS": 2048, "POINTER_LOADS": False}, num_warps=8)
    # overlap_kernels.matmul: the same kernel with no peer to wait for, FAST_SIGNALS off.
    matmul = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "NUM_PROGRAMS": 132, "NUM_STAGES": 3,
              "B_NK": True, "INPUT_PRECISION": "tf32", "FAST_SIGNALS": False, "INTERPRETED_BF16": False,
              "SUM_ROWS": 16, "TMA_EPILOGUE": False, "PUSH_ROWS": False, "PUSH_WORDS": 2048, "POINTER_LOADS": False}
    bf16_sig = {k: v.replace("DT", "bf16") for k, v in gemm_sig.items()}
    build("matmul_bf16_nk", gemm.chunked_gemm_kernel, bf16_sig, matmul, num_warps=8)
    # ... and its wave-fill tiles at 513-1024 rows (templates/ag_gemm.toml: wave_fill_tiles)
    build("matmul_bf16_nk_wave_fill", gemm.chunked_gemm_kernel, bf16_sig,
          {**matmul, "BLOCK_M": 64, "NUM_STAGES": 4}, num_warps=4)
    # ag_gemm's mechanism "push": the GEMM pushes this rank's rows to every rank first.
    build("gemm_bf16_nk_pushed", gemm.chunked_gemm_kernel, {k: v.replace("DT", "bf16") for k, v in pushed_sig.items()},
          {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "NUM_PROGRAMS": 131, "NUM_STAGES": 3,
           "B_NK": True, "INPUT_PRECISION": "tf32", "FAST_SIGNALS": True, "INTERPRETED_BF16": False,
           "SUM_ROWS": 16, "TMA_EPILOGUE": False, "PUSH_ROWS": True, "PUSH_WORDS": 2048, "POINTER_LOADS": False}, num_warps=8)
    build("exchange_ready", transfer.exchange_ready_kernel,
          {"peer_table_ptr": "*i64", "ready_offset": "i32", "rank": "i32", "world": "i32",
           "ready_flags_ptr": "*i32", "sources_ptr": "*i32", "num_sources": "i32", "epoch": "i32",
           "err_addr": "i64", "budget": "i64", "word": "i32"}, {"FAST_SIGNALS": True})
    build("signal", signals.signal_kernel, {"flags_ptr": "*i32", "slot": "i32", "epoch": "i32", "local_flags_ptr": "*i32",
                                            "writer": "i32", "word": "i32"}, {})
    build("enter_replay", transfer.enter_replay_kernel,
          {"peer_table_ptr": "*i64", "ready_offset": "i32", "rank": "i32", "world": "i32",
           "ready_flags_ptr": "*i32", "sources_ptr": "*i32", "num_sources": "i32", "epoch_ptr": "*i32",
           "err_addr": "i64", "budget": "i64", "word": "i32"}, {"FAST_SIGNALS": True})
    build("pull_chunks", transfer.pull_chunks_kernel,
          {"peer_table_ptr": "*i64", "rank": "i32", "buffer_offset": "i64", "chunks_ptr": "*i64",
           "num_chunks": "i32", "counters_ptr": "*i32", "ready_flags_ptr": "*i32", "chunk_flags_ptr": "*i32", "epoch": "i32",
           "err_addr": "i64", "budget": "i64", "word": "i32"},
          {"NUM_PROGRAMS": 8, "BLOCK_WORDS": 8192, "FAST_SIGNALS": True})
    reduce_sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                  "stride_out": "i32", "out_rows": "i32", "scale": "fp32", "tiles_ptr": "*i32", "num_tiles": "i32", "num_programs": "i32",
                  "peer_table_ptr": "*i64", "rank": "i32", "world": "i32", "slots_offset": "i64",
                  "slot_rows": "i32", "rows_offset": "i64", "half_bytes": "i64", "flags_offset": "i32",
                  "local_flags_ptr": "*i32",
                  "wait_stride": "i32", "counters_ptr": "*i32", "num_counters": "i32", "epoch": "i32", "err_addr": "i64",
                  "wait_budget": "i64", "word": "i32"}
    for b_nk, tma in ((True, False), (False, False), (True, True)):
        build(f"reduce_gemm_{'nk' if b_nk else 'kn'}{'_tma' if tma else ''}", reduce_gemm.reduce_gemm_kernel,
              dict(reduce_sig),
              {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "NUM_STAGES": 3, "B_NK": b_nk,
               "INPUT_PRECISION": "tf32", "FAST_SIGNALS": True, "INTERPRETED_BF16": False, "TMA_EPILOGUE": tma,
               "POINTER_LOADS": False},
              num_warps=8)
    # Decode tiles (the templates' 16x64x128, 6 stages) with the operands read by TMA and by
    # masked loads (config loads="pointer"), the chunked GEMM (matmul, ag_gemm) and gemm_ar's
    # one-shot; and at one stage, where the loads are not pipelined.
    decode = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "B_NK": True, "INPUT_PRECISION": "tf32",
              "FAST_SIGNALS": True, "INTERPRETED_BF16": False, "TMA_EPILOGUE": False}
    chunked = {"GROUP_M": 1, "NUM_PROGRAMS": 132, "SUM_ROWS": 16, "PUSH_ROWS": False, "PUSH_WORDS": 2048}
    for name, loads, stages in (("tma", False, 6), ("pointer_loads", True, 6), ("plain_loads", True, 1)):
        build(f"decode_gemm_{name}", gemm.chunked_gemm_kernel,
              {k: v.replace("DT", "bf16") for k, v in gemm_sig.items()},
              {**decode, **chunked, "NUM_STAGES": stages, "POINTER_LOADS": loads},
              aligned=("a_ptr", "b_ptr", "c_ptr", "N", "K"), num_warps=4)
    for name, loads in (("tma", False), ("pointer_loads", True)):
        build(f"decode_reduce_{name}", reduce_gemm.reduce_gemm_kernel, dict(reduce_sig),
              {**decode, "NUM_STAGES": 6, "POINTER_LOADS": loads},
              aligned=("a_ptr", "b_ptr", "out_ptr", "N", "K"), num_warps=4)
    grouped_sig = {"a_ptr": "*bf16", "stride_am": "i32", "slots_ptr": "*i64", "records_ptr": "*i32",
                   "b_ptr": "*bf16", "stride_be": "i64", "stride_bk": "i32", "stride_bn": "i32",
                   "out_ptr": "*bf16", "stride_om": "i32", "out_rows": "i32", "weights_ptr": "*fp32",
                   "dst_addr_ptr": "*i64",
                   "tiles_ptr": "*i32", "num_tiles": "i32", "flags_ptr": "*i32", "epoch": "i32", "err_addr": "i64",
                   "budget": "i64", "K": "i32", "N": "i32", "num_rows": "i32", "num_experts": "i32"}
    # The fused dispatch GEMM (gathered rows, waits) at the template's tiles, storing whole
    # blocks by TMA and (its twin) by pointers, and the fused combine GEMM (push epilogue).
    for name, a_rows, wait, push, tma_epilogue in (("grouped_dispatch", 1, True, False, True),
                                                   ("grouped_dispatch_pointer_store", 1, True, False, False),
                                                   ("grouped_combine", 0, False, True, False)):
        build(name, grouped_gemm.grouped_gemm_kernel, dict(grouped_sig),
              {"A_ROWS": a_rows, "WAIT": wait, "PUSH": push, "A_TMA": a_rows == 0, "B_TMA": True, "B_NK": False,
               "TMA_EPILOGUE": tma_epilogue, "OUT_DTYPE": triton.language.bfloat16, "INPUT_PRECISION": "tf32",
               "INTERPRETED_BF16": False,
               "NUM_PROGRAMS": 132, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "FAST_SIGNALS": True},
              num_warps=8, num_stages=3)
    # MoE routing and combine sums: plain kernels, they must build.
    build("route_rows", routing.rows_kernel, {"ids_ptr": "*i64", "num_tokens": "i32", "k": "i32",
          "experts_per_rank": "i32", "row_in_block_ptr": "*i64", "tokens_ptr": "*i64", "sends_ptr": "*i32",
          "world": "i32"}, {"BLOCK": 128, "K": 8})
    build("route_count", routing.count_kernel, {"ids_ptr": "*i64", "num_tokens": "i32", "k": "i32",
          "num_experts": "i32", "header_ptr": "*i32", "pairs_ptr": "*i32", "hidden": "i32", "itemsize": "i32"},
          {"BLOCK": 1024})
    build("route_place", routing.place_kernel, {"ids_ptr": "*i32", "weights_ptr": "*bf16", "num_tokens": "i32",
          "k": "i32", "experts_per_rank": "i32", "pairs_ptr": "*i32", "row_in_block_ptr": "*i64", "world": "i32",
          "records_ptr": "*i32", "pair_slots_ptr": "*i64"}, {"BLOCK": 1024, "BLOCK_E": 256})
    build("gather_sum", gather_sum.gather_sum_kernel, {"rows_ptr": "*i64", "width": "i32", "base": "i64",
          "column_bases_ptr": "*i64", "row_bytes": "i64", "scales_ptr": "*fp32", "out_ptr": "*bf16",
          "stride_out": "i32", "N": "i32"},
          {"SRC_DTYPE": triton.language.bfloat16, "COLUMN_BASES": True, "HAS_SCALES": True,
           "INTERPRETED_BF16": False, "BLOCK_N": 1024})
    # The MoE graph mode's dispatch and combine (one launch each), at DeepSeek-V3's shapes on 4 ranks.
    graph_ring = {"peer_table_ptr": "*i64", "rank": "i32", "world": "i32", "region": "i64", "half_bytes": "i64",
                  "block_bytes": "i64"}
    graph_signals = {"local_flags_ptr": "*i32", "flag0": "i32", "flag_stride": "i32", "done_ptr": "*i32",
                     "epoch": "i32", "err_addr": "i64", "budget": "i64", "word": "i32", "max_tokens": "i32",
                     "max_topk": "i32"}
    build("moe_graph_dispatch", moe_graph.dispatch_kernel,
          {"x_ptr": "*bf16", "stride_x": "i32", "num_tokens": "i32", "hidden": "i32", "counts_ptr": "*i32",
           "counts_len": "i32", "records_ptr": "*i32", "dest_tokens_ptr": "*i64", "capacity": "i32",
           "recv_x_ptr": "*bf16", "src_rank_ptr": "*i32", "src_token_ptr": "*i32", "weight_bits_ptr": "*i32",
           "owner_ptr": "*i32", "expert_counts_ptr": "*i32", "expert_ends_ptr": "*i32", "recv_tokens_ptr": "*i32",
           "record_addr": "i64", "num_programs": "i32", **graph_ring, "tokens_at": "i32", "records_at": "i32",
           "row_stride": "i32", **graph_signals, "num_experts": "i32", "e_local": "i32"},
          {"BLOCK_ROWS": 8, "BLOCK_H": 512, "BLOCK_W": 4, "BLOCK_E": 256, "BLOCK_EL": 64, "BLOCK_C": 1024,
           "FAST_SIGNALS": True},
          aligned=("x_ptr", "stride_x", "recv_x_ptr", "hidden"), num_warps=4)
    build("moe_graph_combine", moe_graph.combine_kernel,
          {"y_ptr": "*bf16", "stride_y": "i32", "width": "i32", "weights_ptr": "*fp32", "owner_ptr": "*i32",
           "recv_tokens_ptr": "*i32", "row_in_block_ptr": "*i64", "num_tokens": "i32", "out_ptr": "*bf16",
           "stride_out": "i32", "num_programs": "i32", **graph_ring, "row_stride": "i32", **graph_signals},
          {"BLOCK_N": 1024, "INTERPRETED_BF16": False, "FAST_SIGNALS": True},
          aligned=("y_ptr", "stride_y", "width", "out_ptr", "stride_out"), num_warps=4)
    build("expand_runs", runs.expand_runs_kernel, {"table_ptr": "*i64", "out_ptr": "*i64"},
          {"BLOCK": 128, "RUNS": 256}, num_warps=4)
    build("silu_mul", activation.silu_mul_kernel, {"h_ptr": "*bf16", "stride_h": "i32", "out_ptr": "*bf16",
          "stride_out": "i32", "F": "i32"}, {"BLOCK": 1024, "INTERPRETED_BF16": False}, num_warps=4)
    # The one-shot all-reduce, alone and with the residual add and RMSNorm after it.
    all_reduce_sig = {"x_ptr": "*bf16", "stride_x": "i32", "out_ptr": "*bf16", "stride_out": "i32", "M": "i32",
                      "N": "i32", "residual_ptr": "*bf16", "stride_residual": "i32", "normed_ptr": "*bf16",
                      "stride_normed": "i32", "weight_ptr": "*bf16", "eps": "fp32", "num_programs": "i32",
                      "peer_table_ptr": "*i64", "rank": "i32", "world": "i32", "slots_offset": "i64",
                      "slot_bytes": "i64", "half_bytes": "i64", "local_flags_ptr": "*i32", "flag0": "i32", "flag_stride": "i32",
                      "done_ptr": "*i32", "epoch": "i32", "err_addr": "i64", "wait_budget": "i64", "word": "i32"}
    for name, norm in (("all_reduce", False), ("all_reduce_rmsnorm", True)):
        build(name, all_reduce.all_reduce_kernel, dict(all_reduce_sig),
              {"BLOCK_ROWS": 2, "BLOCK_COLS": 2048, "NORM": norm, "RESIDUAL": norm, "INTERPRETED_BF16": False,
               "FAST_SIGNALS": True}, num_warps=4,
              aligned=("x_ptr", "out_ptr", "residual_ptr", "normed_ptr", "N", "stride_x", "stride_out",
                       "stride_residual", "stride_normed", "slots_offset", "slot_bytes"))
    build("wait", transfer.wait_kernel,
          {"flags_ptr": "*i32", "slot": "i32", "epoch": "i32", "err_addr": "i64", "budget": "i64", "peer": "i32",
           "word": "i32"},
          {"FAST_SIGNALS": True})
    # Users' kernels on the device API (overlap_kernels.language): the three examples, their
    # context's signals compiled (FAST), bf16 tiles of 128x128x64 on 8 warps.
    from overlap_kernels.language import Context
    import examples.ag_rmsnorm_gemm, examples.ag_swiglu, examples.gemm_rs_bias
    ctx_sig = Context(tiles="*i32", num_tiles="i32", programs="i32", counters="*i32", claim="i32",
                      flags="*i32", peers="*i64", rank="i32", world="i32", slots="i64", slot_rows="i32",
                      n="i32", half_bytes="i32", wait_stride="i32", first_row="i32", epoch="i64",
                      err="i64", budget="i64", word="i32", FAST="constexpr")
    user_tiles = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}
    for name, fn, operands in (
            ("user_ag_swiglu", examples.ag_swiglu._ag_swiglu_kernel, ("x_ptr", "wg_ptr", "wu_ptr", "out_ptr")),
            ("user_ag_rmsnorm_gemm", examples.ag_rmsnorm_gemm._ag_rmsnorm_gemm_kernel,
             ("x_ptr", "gain_ptr", "w_ptr", "out_ptr")),
            ("user_gemm_rs_bias", examples.gemm_rs_bias._gemm_rs_bias_kernel,
             ("x_ptr", "w_ptr", "bias_ptr", "res_ptr", "out_ptr"))):
        sig = {**{arg: "*bf16" for arg in operands}, "M": "i32", "N": "i32", "K": "i32", "ctx": ctx_sig}
        if "eps" in fn.arg_names:
            sig["eps"] = "fp32"
        fast = {(fn.arg_names.index("ctx"), Context._fields.index("FAST")): True}
        build(name, fn, sig, {**user_tiles, **fast}, aligned=operands, num_warps=8)
    print(json.dumps({"calls": next(calls), "report": report}))
    """
)
# The builds are independent: one compiler process per core, at most 4 (each imports Triton
# and the kernels first, ~2 s), each building its share of them.
PARTS = max(1, min(4, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def report():
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, str(part), str(PARTS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for part in range(PARTS)
    ]
    report, calls = {}, set()
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"sm_90 compile failed:\n{err[-4000:]}"
            part = json.loads(out.strip().splitlines()[-1])
            report.update(part["report"])
            calls.add(part["calls"])
    finally:
        for proc in procs:
            proc.kill()  # (one still compiling after another failed; an ended one: nothing)
    assert len(calls) == 1 and len(report) == calls.pop(), "a kernel was built twice or never"
    return report


def test_all_reduce_pushes_in_vectors_signals_after_a_fence_and_waits(report):
    # Pushed blocks move as 16-byte vectors; each block's signals to its peers follow one
    # sys-scope fence (relaxed max atomics); the waits are the fast acquire spin with a
    # deadline; the RMSNorm variant also builds.
    for name in ("all_reduce", "all_reduce_rmsnorm"):
        r = report[name]
        assert r["vector_stores"] > 0 and r["vector_loads"] > 0, (name, r)
        assert r["fenced_signal"] > 0, (name, r)
        assert r["acquire"] > 0 and r["globaltimer"] > 0, (name, r)


def test_gemm_uses_wgmma_tma_and_fast_waits(report):
    for name, info in report.items():
        if not name.startswith("gemm_"):
            continue
        # Exact fp32 (input_precision="ieee", torch's default) has no tensor-core path.
        assert info["wgmma"] > 0 or name.startswith("gemm_fp32"), (
            f"{name}: no wgmma (slow matrix path)"
        )
        assert info["tma"] > 0, f"{name}: no TMA loads"
        assert info["acquire"] > 0 and info["globaltimer"] > 0, (
            f"{name}: wait is not the fast PTX spin"
        )
        assert info["proxy_fence"] > 0, f"{name}: no proxy fence before TMA reads of arrived data"
        assert info["shared"] <= SHARED_MEMORY_BYTES, (
            f"{name}: {info['shared']} B of shared memory > {SHARED_MEMORY_BYTES}"
        )


def test_matmul_compiles_with_fast_signals_off(report):
    """overlap_kernels.matmul compiles the chunked GEMM with FAST_SIGNALS off: its wait
    branch reads the interpreter's clock word, a constexpr global the compiler must accept."""
    for name in ("matmul_bf16_nk", "matmul_bf16_nk_wave_fill"):
        info = report[name]
        assert info["wgmma"] > 0 and info["tma"] > 0, f"{name}: not wgmma on TMA loads"
        assert info["globaltimer"] == 0, f"{name}: a fast wait where no peer signals"
        assert info["shared"] <= SHARED_MEMORY_BYTES, f"{name}: {info['shared']} B of shared memory"


def test_chunked_gemm_tma_epilogue_fits_and_stores_by_tma(report):
    info = report["gemm_bf16_nk_tma"]
    assert info["tma_store"] > 0, "epilogue='tma' compiled without TMA stores"
    assert report["gemm_bf16_nk"]["tma_store"] == 0, "pointer epilogue should not use TMA stores"
    # checks.check_tiles_fit counts the output tile the TMA stores keep beside the staged tiles.
    assert info["shared"] - report["gemm_bf16_nk"]["shared"] >= 128 * 256 * 2


def test_pushing_gemm_copies_in_vectors_then_counts_signals_and_waits(report):
    info, plain = report["gemm_bf16_nk_pushed"], report["gemm_bf16_nk"]
    assert info["vector_loads"] > plain["vector_loads"], "pushed rows: no 16-byte vector loads"
    assert info["vector_stores"] > plain["vector_stores"], "pushed rows: no 16-byte vector stores"
    assert info["acq_rel"] > 0, "the programs' count is not an acq_rel sys atomic"
    assert info["fenced_signal"] > 0 and info["barrier"] > 0, (
        "no barrier + sys fence + relaxed sys atomic for the pushed rows' flags"
    )
    assert info["acquire"] > 0 and info["globaltimer"] > 0, "the wait is not the fast PTX spin"
    assert plain["acq_rel"] == 0 and not plain["fenced_signal"], "a plain GEMM signals nothing"
    assert info["shared"] <= SHARED_MEMORY_BYTES


def test_pointer_loads_read_operands_in_vectors_without_tma(report):
    """Against the same tiles read by TMA: the pipelined loads are 16-byte asynchronous
    copies, the unpipelined ones 16-byte vector loads, and neither is a TMA load."""
    for kernel in ("decode_gemm", "decode_reduce"):
        tma, pointer = report[f"{kernel}_tma"], report[f"{kernel}_pointer_loads"]
        assert tma["tma"] > 0 and tma["async_copies"] == 0
        assert pointer["tma"] == 0, f"{kernel}: loads='pointer' compiled TMA loads"
        assert pointer["async_copies"] > 0, f"{kernel}: no 16-byte asynchronous copies"
        for info in (pointer, tma):
            assert info["wgmma"] + info["mma"] > 0, f"{kernel}: no tensor-core product"
            assert info["acquire"] > 0 and info["globaltimer"] > 0, (
                f"{kernel}: wait is not the fast PTX spin"
            )
            assert info["shared"] <= SHARED_MEMORY_BYTES
    plain = report["decode_gemm_plain_loads"]
    assert plain["tma"] == 0 and plain["async_copies"] == 0
    assert plain["vector_loads"] > report["decode_gemm_tma"]["vector_loads"], (
        "one stage: the operands are not read by 16-byte vector loads"
    )


def test_transfer_kernels_compile_with_release_and_acquire(report):
    assert report["exchange_ready"]["acquire"] > 0
    assert report["pull_chunks"]["acquire"] > 0
    # The SM copy moves 16-byte vectors (rows are 16-byte aligned on the fused path).
    assert report["pull_chunks"]["vector_loads"] > 0, "pull_chunks: no 16-byte vector loads"
    assert report["pull_chunks"]["vector_stores"] > 0, "pull_chunks: no 16-byte vector stores"
    for name in ("signal", "pull_chunks"):
        assert report[name]["release"] > 0, f"{name}: no sys-scope release"
        assert report[name]["barrier"] > 0, f"{name}: no CTA barrier before the release"
    # exchange_ready and a replayed call's entry set one flag per rank: barrier, one sys
    # fence, then relaxed sys atomics; then they wait.
    for name in ("exchange_ready", "enter_replay"):
        info = report[name]
        assert info["fenced_signal"] > 0 and info["barrier"] > 0, \
            f"{name}: no barrier + sys fence + relaxed sys atomic for the ready flags"  # fmt: skip
        assert info["acquire"] > 0, f"{name}: no acquire wait"


def test_reduce_gemm_signals_and_waits(report):
    for name in ("reduce_gemm_nk", "reduce_gemm_kn", "reduce_gemm_nk_tma"):
        info = report[name]
        assert info["wgmma"] > 0 and info["tma"] > 0, f"{name}: not the wgmma/TMA GEMM core"
        assert info["acquire"] > 0 and info["globaltimer"] > 0, (
            f"{name}: reduction wait is not the fast PTX spin"
        )
        assert info["acq_rel"] > 0, f"{name}: piece counter is not an acq_rel sys atomic"
        assert info["fenced_signal"] > 0 and info["barrier"] > 0, (
            f"{name}: no barrier + sys fence + relaxed sys atomic for the piece flags"
        )
        assert info["shared"] <= SHARED_MEMORY_BYTES, (
            f"{name}: {info['shared']} B of shared memory > {SHARED_MEMORY_BYTES}"
        )
    assert report["wait"]["acquire"] > 0


def test_tma_epilogue_stores_through_tma_and_waits_before_signalling(report):
    assert report["reduce_gemm_nk"]["tma_store"] == 0, "pointer epilogue should not use TMA stores"
    info = report["reduce_gemm_nk_tma"]
    assert info["tma_store"] > 0, "epilogue='tma' compiled without TMA stores"
    assert info["bulk_wait"] > 0, "no bulk wait before the piece is signalled"


def test_grouped_gemm_uses_wgmma_and_fast_waits(report):
    for name in ("grouped_dispatch", "grouped_dispatch_pointer_store", "grouped_combine"):
        info = report[name]
        assert info["wgmma"] > 0, f"{name}: no wgmma (slow matrix path)"
        assert info["shared"] <= SHARED_MEMORY_BYTES, (
            f"{name}: {info['shared']} B of shared memory > {SHARED_MEMORY_BYTES}"
        )
    assert (
        report["grouped_dispatch"]["acquire"] > 0 and report["grouped_dispatch"]["globaltimer"] > 0
    )
    assert report["grouped_combine"]["acquire"] == 0, "the combine GEMM waits on nothing"


def test_grouped_gemm_tma_epilogue_stores_by_tma_in_the_shared_memory_checked(report):
    """epilogue='tma' stores whole blocks by TMA from a 128x256 bf16 output tile, the
    memory check_tiles_fit(store_buffer=True) counts beside the stages."""
    tma, pointer = report["grouped_dispatch"], report["grouped_dispatch_pointer_store"]
    assert tma["tma_store"] > 0, "epilogue='tma' compiled without TMA stores"
    assert pointer["tma_store"] == 0, "pointer epilogue should not use TMA stores"
    assert tma["shared"] - pointer["shared"] >= 128 * 256 * 2


def test_moe_routing_and_combine_kernels_build(report):
    for name in (
        "route_count",
        "route_place",
        "route_rows",
        "gather_sum",
        "silu_mul",
        "expand_runs",
    ):
        assert name in report, f"{name} did not build for sm_90"


def test_users_kernels_on_the_device_api_use_wgmma_tma_and_the_contracts_signals(report):
    """The examples' kernels (overlap_kernels.language): the GEMM on wgmma and TMA, every
    wait the fast PTX spin with its deadline and proxy fence; the reduce-scatter's
    signals a barrier, an acq_rel sys count and a fenced relaxed sys flag."""
    for name in ("user_ag_swiglu", "user_ag_rmsnorm_gemm", "user_gemm_rs_bias"):
        info = report[name]
        assert info["wgmma"] > 0 and info["tma"] > 0, f"{name}: not wgmma on TMA loads"
        assert info["acquire"] > 0 and info["globaltimer"] > 0, (
            f"{name}: wait is not the fast PTX spin"
        )
        assert info["proxy_fence"] > 0, f"{name}: no proxy fence before TMA reads of arrived data"
        assert info["shared"] <= SHARED_MEMORY_BYTES, f"{name}: {info['shared']} B of shared memory"
    signals = report["user_gemm_rs_bias"]
    assert signals["acq_rel"] > 0 and signals["fenced_signal"] > 0 and signals["barrier"] > 0, (
        "put_tile/signal_tile: no barrier + acq_rel sys count + sys fence + relaxed sys flag"
    )
    assert report["user_ag_swiglu"]["fenced_signal"] == 0, "a gather op's kernel signals nothing"


def test_moe_graph_kernels_wait_signal_and_move_vectors(report):
    """The graph mode's dispatch and combine: fast bounded waits, the programs' count
    (acq_rel, sys scope) and the fenced relaxed signals, and rows moved in 16-byte vectors."""
    for name in ("moe_graph_dispatch", "moe_graph_combine"):
        info = report[name]
        assert info["acquire"] > 0 and info["globaltimer"] > 0, f"{name}: no fast bounded wait"
        assert info["acq_rel"] > 0, f"{name}: the programs' count is not acq_rel at sys scope"
        assert info["fenced_signal"] > 0 and info["barrier"] > 0, (
            f"{name}: no fenced relaxed signal"
        )
        assert info["vector_stores"] > 0 and info["vector_loads"] > 0, (
            f"{name}: rows not moved in vectors"
        )


_CACHE_KEYS = textwrap.dedent(
    """
    import json, os
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from overlap_kernels.kernels import (activation, all_reduce, gather_sum, gemm, grouped_gemm, moe_graph,
                                         reduce_gemm, routing, runs, transfer)
    from overlap_kernels import language
    keys = {}
    for module in (activation, all_reduce, gather_sum, gemm, grouped_gemm, moe_graph, reduce_gemm,
                   routing, runs, transfer, language):
        for name, fn in vars(module).items():
            if isinstance(fn, triton.runtime.JITFunction):
                keys[f"{module.__name__}.{name}"] = fn.cache_key
    print(json.dumps(keys))
    """
)


def test_kernels_cache_keys_are_the_same_in_every_process():
    """A kernel's Triton cache key holds the values of the constexpr globals it reads:
    one that differs per process (an address) would make every process compile every
    kernel that waits again instead of loading it from Triton's cache."""
    runs = [
        json.loads(subprocess.run([sys.executable, "-c", _CACHE_KEYS], check=True,
                                  capture_output=True, text=True).stdout)
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0], "no kernel found"
    assert any("wait" in name or "gemm" in name for name in runs[0])
    differ = sorted(name for name in runs[0] if runs[0][name] != runs[1].get(name))
    assert not differ, f"cache keys differ between two processes: {differ}"
