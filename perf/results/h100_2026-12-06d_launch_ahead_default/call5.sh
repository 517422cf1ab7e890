#!/bin/bash
# Call 5 (same warm machine): the default (auto) served at 16 and 64.
bash perf/h200_serve_slice.sh --tag auto c16:16:256 c64:64:256:probe > /tmp/auto.out 2>&1; grep -v "^2026" /tmp/auto.out | tail -12; rm -f $OUT/*serve.log.gz
