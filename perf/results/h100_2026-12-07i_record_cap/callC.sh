#!/bin/bash
# Stop 63, call C (one fresh machine, ~420 s): what matters most in one call. The GPU tests of
# the graph paths stop 62 refactored, then HEAD at C 16 with the defaults (its start runs the
# whole warm-up and writes the record) and with the demand cap 1.2 (its start runs the record's
# plans: compare the start-up lines; compile warnings after ready must stay 0).
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
T=tests/gpu/test_hopper_engine.py::
step engine 200 python3 -m pytest -q -x ${T}test_cuda_graphs_on_and_off_give_identical_tokens ${T}test_piecewise_prefill_graphs_on_and_off_give_identical_tokens ${T}test_graphs_that_draw_their_rows_give_the_eager_draws ${T}test_steps_with_prompt_tokens_drawn_in_graphs_give_the_eager_draws tests/gpu/test_piecewise_gpu.py tests/gpu/test_spec_hopper_gpu.py
tail -3 $OUT/engine.txt
for t in new cap12; do
  a=(); [ $t = cap12 ] && a=(--serve-arg --mixed-step-demand-margin --serve-arg 1.2)
  timeout 190 bash perf/h200_serve_slice.sh --tag $t "${a[@]}" c16:16:192 > $OUT/${t}_console.txt 2>&1
  echo "$t rc=$?"; pkill -f "m3serve serve"; sleep 2; grep -E "^concurrency|compile warnings" $OUT/${t}_console.txt
  tar xzf $OUT/${t}_results.tgz -O --wildcards '*serve.log' 2>/dev/null | grep -E "start-up [0-9]" | cut -c1-300
done
grep -E "^== |inter-token|launched ahead|^mixed" $OUT/new_trace.txt $OUT/cap12_trace.txt | cut -c1-220 | head -24
cd $OUT && tar czf packed.tgz --remove-files $(ls | grep -vE "^(new_trace.txt|cap12_trace.txt|engine.txt)$") ; ls $OUT
