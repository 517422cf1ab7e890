"""Compile the attention prefill kernels for sm_90 offline (no GPU) at the served shapes."""
import argparse
import sys

sys.path.insert(0, "perf")
import sm90_resources as tool

args = argparse.Namespace(ptxas="/usr/local/cuda/bin/ptxas", sass=False)
sys.path.append("/work/venv/lib/python3.11/site-packages")
from m3serve.kernels.triton.attention import prefill  # noqa: E402

types = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "page_table_ptr": "*i32",
    "seq_lens_ptr": "*i32", "starts_ptr": "*i32", "pos_ptr": "*i64", "ids_ptr": "*i32",
    "plan_ptr": "*i32", "count_ptr": "*i32", "out_ptr": "*bf16", "qk_scale": "fp32",
}
for block_b in (2, 64, 256):
    consts = {"G": 16, "G_PAD": 16, "BLOCK_T": 8, "D": 128, "PAGE": 128, "BLOCK_N": 64, "CPP": 2,
              "K_PAD": 16, "BLOCK_B": block_b, "SPARSE": True, "DOT_F32": False, "PREC": "tf32"}
    tool.report(f"prefill BLOCK_B {block_b}", prefill._prefill_kernel, types, consts, 8, args, 2)
    plan = {"BLOCK_T": 8, "K_PAD": 16, "BLOCK_B": block_b}
    tool.report(f"plan BLOCK_B {block_b}", prefill._prefill_plan_kernel, types, plan, 4, args)
