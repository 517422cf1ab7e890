"""The NVFP4 MoE's align CHUNK (64, served, against 128) at prefill: the layer's MoE at T 512,
2048, 4096 in one process, alternating. Runs bench_nvfp4_moe's prefill path per CHUNK."""
import sys
import subprocess
for chunk in (64, 128, 64, 128):
    code = (
        "import m3serve.kernels.triton.nvfp4_moe.align as a; a.CHUNK = %d; import sys, runpy; "
        "sys.argv = ['bench_nvfp4_moe.py', '--tokens', '', '--prefill', '512,2048,4096', "
        "'--no-grouped', '--out', '/tmp/chunk%d.json']; "
        "runpy.run_path('perf/bench_nvfp4_moe.py', run_name='__main__')" % (chunk, chunk)
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"== CHUNK {chunk}", flush=True)
    print("\n".join(l for l in r.stdout.splitlines() if l.strip())[-1500:], flush=True)
    if r.returncode:
        print(r.stderr[-2000:])
