export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash scripts/setup.sh > /dev/null 2>&1; echo setup rc=$?
timeout 200 python3 -m pytest tests/test_examples.py tests/test_deadlines.py -m gpu -n 4 -v -p no:cacheprovider > $OUT/gpu_tests_x4.log 2>&1; echo tests rc=$?
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_tests_x4.log | tail -22
timeout 100 python3 -m bench.experiments.probe_plain_watch --m 16 256 > $OUT/probe_plain_watch_x4.log 2>&1; echo probe rc=$?; tail -20 $OUT/probe_plain_watch_x4.log
timeout 110 python3 -m bench --op gemm_ar --shapes 16x7168x8192 64x7168x8192 256x7168x8192 > $OUT/bench_gemm_ar_decode_x4.log 2>&1; echo gemm_ar rc=$?
timeout 100 python3 -m bench.host_time --world 4 --gpus 4 --ops gemm_ar gemm_rs > $OUT/host_time_x4.log 2>&1; echo host_time rc=$?; tail -14 $OUT/host_time_x4.log | head -9
sed -n '/^gemm_ar$/,$p' $OUT/bench_gemm_ar_decode_x4.log | head -14
