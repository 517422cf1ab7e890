set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
tar xzf .scratch/tcache.tgz -C /tmp
t=$(date +%s)
timeout 200 python3 -m pytest -q tests/gpu/test_mxfp8_linear_gpu.py tests/gpu/test_nvfp4_moe_gpu.py tests/gpu/test_hopper_quantized.py tests/gpu/test_router_gpu.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s)-t )) s"; tail -3 $OUT/tests.txt
t=$(date +%s)
timeout 120 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 --out $OUT/parts.json > $OUT/parts.txt 2>&1; echo "parts rc=$? $(( $(date +%s)-t )) s"
grep -A12 "read bandwidth" $OUT/parts.txt
t=$(date +%s)
timeout 150 python3 perf/bench_moe_layer.py --out $OUT/moe_layer.json > $OUT/moe_layer.txt 2>&1; echo "moe_layer rc=$? $(( $(date +%s)-t )) s"
tail -7 $OUT/moe_layer.txt
t=$(date +%s)
timeout 100 python3 perf/bench_nvfp4_moe.py --no-grouped --out $OUT/nvfp4_moe.json > $OUT/nvfp4_moe.txt 2>&1; echo "nvfp4 rc=$? $(( $(date +%s)-t )) s"
tail -16 $OUT/nvfp4_moe.txt
tar czf $OUT/tcache.tgz -C /tmp tcache
