. perf/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
t0=$(date +%s)
timeout 240 python3 .scratch/ab_mxfp8.py "$OUT/ab.json" > "$OUT/ab.txt" 2>&1; echo "ab rc=$? $(($(date +%s)-t0)) s"; cat "$OUT/ab.txt" | tail -30
timeout 200 python3 -m pytest -q -x tests/gpu/test_mxfp8_linear_gpu.py > "$OUT/mx_tests.txt" 2>&1; echo "mx tests rc=$? $(($(date +%s)-t0)) s"; tail -3 "$OUT/mx_tests.txt"
timeout 150 python3 -m pytest -q tests/gpu/test_hopper_engine.py -k "overlap or graph" > "$OUT/engine_tests.txt" 2>&1; echo "engine rc=$? $(($(date +%s)-t0)) s"; tail -3 "$OUT/engine_tests.txt"
tar czf "$OUT/tcache.tgz" -C /tmp tcache
