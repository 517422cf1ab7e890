# Sourced by the one-call device scripts (perf/h200_*.sh), from the repo root on the lent
# machine: installs the carried wheels (`.whl`, the README's Notes) into /tmp/site, puts them
# and the repo on the paths, and unpacks a carried Triton cache (`.scratch/tcache.tgz.part*`, a
# tar split in parts) into TRITON_CACHE_DIR, setting `carried` to 1 when there was one;
# `return_triton_cache` packs it into $OUT the same way when none was carried or it grew since
# (a kernel whose source or line moved is compiled again: Triton's key holds both, and on
# 2026-12-06 a stale cache cost a serve's start-up 162 s instead of ~50); `step` runs one
# part of a call under its own time limit. Exits when $OUT is unset (not the device machine) or
# the wheels do not install.
: "${OUT:?run on the device machine, where \$OUT is set}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/tcache
carried=0
parts=(.scratch/tcache.tgz.part*)
if [ -f "${parts[0]}" ]; then cat "${parts[@]}" | tar xz -C /tmp && carried=1; fi
carried_files=$(find /tmp/tcache -type f 2> /dev/null | wc -l)

return_triton_cache() {
  [ $carried = 0 ] || [ "$(find /tmp/tcache -type f | wc -l)" -gt "$carried_files" ] || return 0
  rm -f "$OUT"/tcache.tgz.part*  # in parts: a file back from the device is at most 16 MiB
  tar czf - -C /tmp tcache | split -b 15m - "$OUT/tcache.tgz.part"
}

step() {  # step NAME SECONDS COMMAND...: run with a limit into $OUT/NAME.txt, say how it went
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: rc=$? after $(($(date +%s) - t0)) s"
}
