#!/bin/bash
# Issue 10: the W4A16 MoE with one dot per K tile (decoded halves joined) against the served two
# dots, and ncu stall profiles of the served kernels at T 1 and a 2048-token prefill.
source perf/device_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/log.txt
t0=$(date +%s)
timeout 150 python3 perf/bench_nvfp4_moe.py --tokens 1,2,8,32 --no-grouped --out $OUT/base.json > $OUT/base.txt 2>&1
echo "base rc=$? $(( $(date +%s)-t0 ))s" | tee -a $OUT/log.txt
cp m3serve/kernels/triton/nvfp4_moe/decode.py /tmp/decode_orig.py
cp .scratch/decode_join.py m3serve/kernels/triton/nvfp4_moe/decode.py
timeout 150 python3 perf/bench_nvfp4_moe.py --tokens 1,2,8,32 --no-grouped --out $OUT/join.json > $OUT/join.txt 2>&1
echo "join rc=$? $(( $(date +%s)-t0 ))s" | tee -a $OUT/log.txt
timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_nvfp4_moe_gpu.py 2>&1 | tail -n 4 | tee -a $OUT/log.txt
echo "join tests $(( $(date +%s)-t0 ))s" | tee -a $OUT/log.txt
cp /tmp/decode_orig.py m3serve/kernels/triton/nvfp4_moe/decode.py
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters"
timeout 150 ncu --clock-control none -k regex:gate_up_kernel --launch-skip 1 --launch-count 1 $S python3 .scratch/ncu_drive.py 1 > $OUT/ncu_t1.txt 2>&1
echo "ncu t1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $OUT/log.txt
timeout 150 ncu --clock-control none -k regex:gate_up_kernel --launch-skip 1 --launch-count 1 $S python3 .scratch/ncu_drive.py 2048 > $OUT/ncu_prefill.txt 2>&1
echo "ncu prefill rc=$? $(( $(date +%s)-t0 ))s" | tee -a $OUT/log.txt
grep -h "nvfp4 \|^ *[0-9]* *[0-9]* .*%" $OUT/base.txt $OUT/join.txt | tee -a $OUT/log.txt
