set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
[ -f .scratch/tcache.tgz ] && tar xzf .scratch/tcache.tgz -C /tmp
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t=$(date +%s)
timeout 230 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 --kernels --out $OUT/parts.json > $OUT/parts.txt 2>&1; echo "parts rc=$? $(( $(date +%s)-t )) s"
grep -A40 "read bandwidth" $OUT/parts.txt | head -12
t=$(date +%s)
timeout 200 python3 perf/bench_moe_layer.py --out $OUT/moe_layer.json > $OUT/moe_layer.txt 2>&1; echo "moe_layer rc=$? $(( $(date +%s)-t )) s"
tail -15 $OUT/moe_layer.txt
t=$(date +%s)
timeout 120 python3 -m pytest -q -x tests/gpu/test_router_gpu.py tests/gpu/test_mxfp8_linear_gpu.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s)-t )) s"
tail -3 $OUT/tests.txt
tar czf $OUT/tcache.tgz -C /tmp tcache
