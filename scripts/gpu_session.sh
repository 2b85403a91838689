#!/usr/bin/env bash
# One device session: versions, GPU tests, GEMM core sweeps, the benchmarks.
# Usage: bash scripts/gpu_session.sh [host_time] [host_time_pinned] [tests] [tune] [tune_decode] [tune_models] [ablate] [bench] [untuned]
#                                    [quick] [op=NAME[,NAME...]] [tests=PYTEST_TARGET[,TARGET...]]
# "tests" alone runs every GPU test; tests=... only those targets (file or file::test).
# TEST_WORKERS=N runs the GPU tests in N pytest-xdist workers (several ranks share
# a GPU anyway on a host with fewer GPUs than ranks). Keep N small: processes on one GPU
# take it in time slices, and ranks whose kernels spin on flags then wait through
# others' slices; TEST_SELECT=EXPR passes -k EXPR.
# "bench" runs each op= on its default shapes (tp_mlp, named alone, on TP_MLP_SHAPES);
# "untuned" runs the GEMM ops on UNTUNED_SHAPES, shapes no tuned table names.
# "tune" / "tune_decode" sweep every GEMM core against the vendor (bench.tune_gemm; TUNE_ARGS adds
# arguments, e.g. "--core grouped_gemm"). "tune_models" runs the matmul core's template on the
# models' GEMMs (bench/model_shapes.py): decode replayed in CUDA graphs, prefill, and prefill's dgrad.
# Wheels carried in .whl/ (nvshmem4py, for the nvshmem backend) are installed first.
# Logs, and each benchmark run's JSON (merge them here with `python -m bench.store add`), land
# in $OUT (default /tmp/overlap_out), packed into one session_HHMMSS.tgz at the end; the
# benchmark tables print last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/overlap_out}; mkdir -p "$OUT"; touch "$OUT/.start"
OPS=all; TARGETS=tests
# tp_mlp's default shapes take minutes of torch.compile each: one shape of each model.
TP_MLP_SHAPES=${TP_MLP_SHAPES:-llama3_8b_t4096 llama3_70b_t4096}
# MLP shapes of models no table was tuned on, split for tensor parallelism over 4 ranks
# (also on 2: the same per-rank sizes; M is the token count, ag_gemm's N and gemm_rs's and
# gemm_ar's K are each rank's share): Llama-3-70B (hidden 8192, FFN 28672; ag_gemm with
# gate and up fused), Qwen2-72B (FFN 29568) at an odd M, GPT-3-175B (hidden 12288, FFN
# 49152), and odd decode batches (Llama-3-8B's FFN 14336 at 48 tokens).
UNTUNED_SHAPES=${UNTUNED_SHAPES:-"ag_gemm:4096x8192x14336 ag_gemm:4100x8192x7392 ag_gemm:8192x12288x12288 ag_gemm:96x8192x7168
  gemm_rs:4096x7168x8192 gemm_rs:4100x7392x8192 gemm_rs:8192x12288x12288
  gemm_ar:4100x7392x8192 gemm_ar:8192x12288x12288 gemm_ar:100x7392x8192 gemm_ar:48x3584x4096"}
for a in "$@"; do
  case $a in
    op=*) OPS=${a#op=} ;;
    tests=*) TARGETS=${a#tests=}; set -- "$@" tests ;;
  esac
done
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi -L; nvidia-smi topo -m | head -8
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, 'nccl', torch.cuda.nccl.version())"
bash scripts/setup.sh 2>&1 | tail -2
for STEP in host_time host_time_pinned tests tune tune_decode tune_models ablate bench untuned; do
  case " $* " in *" $STEP "*) ;; *) continue ;; esac
  echo "=== $STEP ==="
  case $STEP in
    tests) workers=${TEST_WORKERS:+-n $TEST_WORKERS}
           timeout "${TEST_TIMEOUT:-170}" python3 -m pytest ${TARGETS//,/ } -m gpu $workers ${TEST_SELECT:+-k "$TEST_SELECT"} \
             -v -p no:cacheprovider --durations=15 > "$OUT/gpu_tests.log" 2>&1
           echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_tests.log" | tail -${TEST_LINES:-20} ;;
    host_time) # fused paths forced: at decode sizes the templates send ag_gemm and gemm_rs to the plain
           # path, whose gloo collectives (ranks sharing the GPU) block the host
           timeout "${HOST_TIME_TIMEOUT:-300}" python3 -m bench.host_time \
             --config ag_gemm='{"path": "fused"}' gemm_rs='{"path": "fused"}' > "$OUT/host_time.log" 2>&1
           echo "host_time rc=$?"; tail -25 "$OUT/host_time.log" ;;
    host_time_pinned) # the same, each rank timed on a physical core of its own
           timeout "${HOST_TIME_TIMEOUT:-300}" python3 -m bench.host_time --pin-cores \
             --config ag_gemm='{"path": "fused"}' gemm_rs='{"path": "fused"}' > "$OUT/host_time_pinned.log" 2>&1
           echo "host_time_pinned rc=$?"; tail -25 "$OUT/host_time_pinned.log" ;;
    tune)  timeout "${TUNE_TIMEOUT:-420}" python3 -m bench.tune_gemm ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" ;;
    tune_decode) timeout "${TUNE_TIMEOUT:-240}" python3 -m bench.tune_gemm --decode ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune_decode.log" ;;
    tune_models) for args in "--decode --graphs" "" "--dgrad"; do
             timeout "${TUNE_TIMEOUT:-240}" python3 -m bench.tune_gemm --core matmul --models --template-only $args 2>&1 \
               | tee -a "$OUT/tune_models.log" | grep "^results:"
           done ;;
    ablate) timeout 240 python3 -m bench.experiments.ablate_reduce --profile 2>&1 | tee "$OUT/ablate_reduce.log" ;;
    bench) extra=""; case " $* " in *" quick "*) extra="--quick" ;; esac
           for op in ${OPS//,/ }; do
             shapes=""; [ "$op" = tp_mlp ] && shapes="--shapes $TP_MLP_SHAPES"
             timeout "${BENCH_TIMEOUT:-540}" python3 -m bench --op "$op" $shapes $extra > "$OUT/bench_$op.log" 2>&1
             echo "bench $op rc=$?"
           done ;;
    untuned) timeout "${BENCH_TIMEOUT:-540}" python3 -m bench --shapes $UNTUNED_SHAPES > "$OUT/bench_untuned.log" 2>&1
           echo "bench untuned rc=$?" ;;
  esac
done
# The tables last, as the logs end: from the first op's name on (each op's table, goals, legend).
for log in "$OUT"/bench_*.log; do
  [ -e "$log" ] && [ "$log" -nt "$OUT/.start" ] && { echo "=== $(basename "$log" .log)"; sed -n '/^[a-z_][a-z_]*$/,$p' "$log"; }
done
# One archive: one file to copy back from a remote host.
(cd "$OUT" && shopt -s nullglob && files=(*.json *.log) && ((${#files[@]})) \
  && tar -czf "session_$(date -u +%H%M%S).tgz" --remove-files "${files[@]}")
