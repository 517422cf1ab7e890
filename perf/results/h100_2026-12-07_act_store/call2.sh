#!/bin/bash
# Stop 52, call 2: issue 11's whole table (C 1, 16, 64 with the decode probe, 128, 256) at
# HEAD; returns the refreshed Triton cache (two kernels changed in stop 51). Carry `.whl`,
# `.scratch`.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |ideal|compile|start-up" | sort -u | tail -16; }
timeout 560 bash perf/h200_serve_slice.sh --tag table > /tmp/t.out 2>&1
echo "== table rc=$? at $(($(date +%s) - t0)) s"; show /tmp/t.out
ls $OUT
