"""The quantized kernels compiled for sm_90 from source on a machine without a GPU: whether each
plan variant of the NVFP4 MoE and of the MXFP8 decode MMA compiles, its registers, spills and
shared memory (ptxas -v), with `--sass` its K loop's length in instructions and the most
frequent opcodes there (cuobjdump; `main_loop` says which loop), with `--stores` its global
stores by width (the PTX's `st.global*`: a store Triton cannot prove contiguous goes out an
element at a time), with `--ptx-hash` a hash of its PTX's code (the same hashes under two
trees' PYTHONPATHs: the same kernels): what a device run would spend minutes finding out. For
example (2026-12-06), the NVFP4 prefill gate_up tile's act store: 40 x `st.global.b16` a thread with
columns scattered by `mma_k_position`, 5 x `st.global.v4.b32` with each program's positions
contiguous and its weight rows gathered. Fewer instructions are not a faster kernel: that
variant was 4 % slower at a 2048-token prefill and at T 32 on an H100 (the gathered rows cost
more than the store saved; reverted, see perf/results/h100_2026-12-07_act_store).

Needs the Triton the GPU machine runs (3.6, which brings cuobjdump) and a CUDA toolkit's ptxas;
the dev box keeps them apart from the project's venv, whose packages come after Triton's on the
path:

    PYTHONPATH=$PWD /tmp/t36/bin/python perf/sm90_resources.py [--sass] [--stores] [--ptx-hash] \
        [--splits 1 2] [--site /work/venv/lib/python3.11/site-packages] \
        [--ptxas /usr/local/cuda/bin/ptxas]

The signatures specialize as a real launch does (16-byte aligned pointers, strides and widths
multiples of 16; pair, expert and token counts not specialized). Prints one line per variant.
For example (Triton 3.6, 2026-12-05): the MXFP8 decode MMA at M tile 16 runs a 737-instruction
loop per 128-wide K step, 5.8 per weight element per thread, of which 3 convert and scale it
(F2FP, HADD2, FMUL, F2FP) and the rest address, load and wait. Before the kernel knew that a K
step's scales start on a 4-byte word, the loop also held 4 synchronous byte loads of them and
their trip through shared memory (775 instructions).

A compile here specializes as a launch does only where told: an integer argument equal to 1
(x's K stride) is a constant in a real launch, and left out it changes the code (2026-12-04's
report of 816 spilled bytes at M tile 64 came from that; with it: 224 registers, no spill).
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

# The variants `plan_moe` picks at M3.1's widths (K tiles of 128): (label, route, P_PAD,
# BLOCK_N, BLOCK_M, TAIL_M, K_TILES, warps, register cap or 0, pipeline stages).
VARIANTS = [
    ("T1 slots", 0, 32, 64, 16, 0, 2, 4, 0, 3),
    ("T8 slots", 0, 32, 128, 16, 0, 1, 4, 0, 3),
    ("T512 sorted", 1, 0, 128, 16, 16, 1, 4, 0, 3),
    ("T1024 sorted", 1, 0, 64, 32, 16, 1, 4, 0, 3),
    ("T2048 sorted", 1, 0, 128, 64, 16, 1, 8, 128, 3),
    ("T2048 sorted, 256 rows", 1, 0, 256, 64, 16, 1, 16, 0, 3),  # rows256_w16: not taken
    ("prefill sorted", 1, 0, 128, 128, 32, 1, 8, 0, 3),
    ("prefill sorted, no tail", 1, 0, 128, 128, 0, 1, 8, 0, 3),
    # bench_nvfp4_moe's block_m128_n64_w4_s2: two programs an SM (measured slower, not taken).
    ("prefill sorted, 64 rows, 2 stages", 1, 0, 64, 128, 32, 1, 4, 0, 2),
    # Blocks of 256 pairs (bench_nvfp4_moe's pairs256*): one decode of an expert's weights for
    # up to 256 (+ tail) pairs, where blocks of 128 decode them twice past 160: measured
    # slower (H100 2026-12-06), not taken.
    ("prefill sorted, 256 pairs", 1, 0, 128, 256, 32, 1, 8, 0, 2),
    ("prefill sorted, 256 pairs, no tail", 1, 0, 128, 256, 0, 1, 8, 0, 2),
    ("prefill sorted, 256 pairs, 64 rows", 1, 0, 64, 256, 0, 1, 4, 0, 2),
]
GATE_UP_TYPES = {
    "alpha": "fp32", "limit": "fp32", "x_ptr": "*bf16", "ids_ptr": "*i32", "sorted_ptr": "*i32",
    "block_expert_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32",
    "act_ptr": "*bf16", "pre_ptr": "*fp32",
}  # fmt: skip
DOWN_TYPES = {
    "act_ptr": "*bf16", "ids_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
    "w_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "tw_ptr": "*fp32", "y_ptr": "*fp32",
}  # fmt: skip


MXFP8_TYPES = {
    "x_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "scales_ptr": "*u8", "out_ptr": "*bf16",
    "part_ptr": "*fp32",
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", default="/work/venv/lib/python3.11/site-packages")
    parser.add_argument("--ptxas", default="/usr/local/cuda/bin/ptxas")
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sass", action="store_true", help="the K loop's instructions too")
    parser.add_argument("--stores", action="store_true", help="global stores by width too")
    parser.add_argument(
        "--ptx-hash", action="store_true", help="a hash of the PTX's code (two trees compared)"
    )
    args = parser.parse_args()
    sys.path.append(args.site)  # after this interpreter's own Triton
    print(f"triton {__import__('triton').__version__}, sm_90")
    nvfp4_moe(args)
    mxfp8_decode(args)


def mxfp8_decode(args: argparse.Namespace) -> None:
    """The MXFP8 MMA kernel at each decode M tile's tiles (`_DECODE_TILES`), direct stores."""
    import triton.language as tl

    from m3serve.kernels.triton.mxfp8_kernels import mxfp8_mma_kernel
    from m3serve.kernels.triton.mxfp8_linear import _DECODE_TILES, plan_mxfp8

    common = {
        "GROUP_M": 8, "X_TERMS": 1, "DOT_DTYPE": tl.bfloat16, "EVEN_K": True, "DIRECT": True,
        "PDL": False,
        # A launch specializes an integer argument equal to 1 as a constant: x's K stride.
        # Left unknown, x's loads neither vectorize nor pipeline.
        "stride_xk": 1,
    }  # fmt: skip
    for block_m, (block_n, block_k, warps, stages, _, served) in sorted(_DECODE_TILES.items()):
        for words in (served, not served) if block_k == 128 else (False,):
            tile = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
            consts = {**common, **tile, "SCALE_WORDS": words}
            scales = ("scale words" if words else "scale bytes") + (" (served)" * (words == served))
            label = f"mxfp8 decode M tile {block_m}, {scales}"
            report(label, mxfp8_mma_kernel, MXFP8_TYPES, consts, warps, args, stages)
    # The prefill tiles (M 65-128 with bf16 x): K steps of 128, each row's scales one word (at K
    # steps of 64, 2 bytes a row were their one synchronous load).
    p = plan_mxfp8(128, 6144, 6144, 132)
    tile = {"BLOCK_M": p.block_m, "BLOCK_N": p.block_n, "BLOCK_K": p.block_k}
    consts = {**common, **tile, "SCALE_WORDS": p.scale_words}
    report(
        "mxfp8 prefill tile", mxfp8_mma_kernel, MXFP8_TYPES, consts, p.num_warps, args, p.num_stages
    )


def nvfp4_moe(args: argparse.Namespace) -> None:
    """The NVFP4 MoE's kernels at the plan's variants, unsplit and K-split."""
    import triton.language as tl

    from m3serve.kernels.triton.nvfp4_moe import kernels

    for split in args.splits:
        for label, route, p_pad, block_n, block_m, tail_m, k_tiles, warps, cap, stages in VARIANTS:
            common = {
                "P_PAD": p_pad, "E_PAD": 128, "SKIPS": False, "BLOCK_M": block_m,
                "TAIL_M": tail_m, "K_TILES": k_tiles, "SPLIT_K": split, "DEQUANT": 0,
                "DOT": tl.bfloat16, "PDL": True, "ROUTE": route, "BLOCK_N": block_n,
                "BLOCK_K": 128,
            }  # fmt: skip
            gate_up = {**common, "TOP_K": 4, "ACT_TILE_K": 128}
            name = f"{label} split {split}"
            report(
                f"gate_up {name}", kernels.gate_up_kernel, GATE_UP_TYPES, gate_up, warps, args,
                stages, max_registers=cap,
            )  # fmt: skip
            report(
                f"down {name}", kernels.down_kernel, DOWN_TYPES, common, warps, args, stages,
                max_registers=cap,
            )  # fmt: skip
        combine = {"TOP_K": 4, "SPLIT_K": split, "BLOCK": 2048, "SKIPS": False, "PDL": True}
        types = {"y_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16"}
        report(f"combine split {split}", kernels.combine_kernel, types, combine, 4, args)
        if split > 1:
            reduce = {"SPLIT_K": split, "BLOCK_P": 16, "BLOCK_N": 256}
            types = {"alpha": "fp32", "limit": "fp32", "pre_ptr": "*fp32", "act_ptr": "*bf16"}
            report(
                f"swiglu_reduce split {split}",
                kernels.swiglu_reduce_kernel,
                types,
                {**reduce, "PDL": True},
                4,
                args,
            )


def report(
    label: str,
    fn: Any,
    types: dict[str, str],
    consts: dict[str, Any],
    warps: int,
    args: argparse.Namespace,
    stages: int = 3,
    max_registers: int = 0,
) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    signature = {
        name: "constexpr"
        if name in consts
        else types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
        for name in fn.arg_names
    }
    aligned = [
        i
        for i, name in enumerate(fn.arg_names)
        if signature[name].startswith("*")
        or (name.startswith("stride") and name != "stride_xk")  # x's K stride is 1
        or name in ("hidden", "inter", "N", "K", "k_per_split")
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    try:
        options = {"num_warps": warps, "num_stages": stages}
        if max_registers:
            options["maxnreg"] = max_registers
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as exc:  # the point of the tool: say which variant fails, go on
        print(f"{label}: does not compile: {type(exc).__name__}: {str(exc)[:2000]}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        command = [args.ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")]
        out = subprocess.run(command, capture_output=True, text=True, check=False).stderr
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill stores", out)
    print(
        f"{label}: {regs[0] if regs else '?'} registers, {spills[0] if spills else '?'} bytes "
        f"spilled, {compiled.metadata.shared} bytes shared"
    )
    if args.sass:
        print("   ", main_loop(compiled.asm["cubin"]))
    if args.stores:
        stores = Counter(re.findall(r"\bst\.global[\w.]*", compiled.asm["ptx"]))
        print("    stores:", ", ".join(f"{n} x {op}" for op, n in sorted(stores.items())))
    if args.ptx_hash:
        # The debug sections and .loc/.file lines hold the source's path, lines and function
        # names: the code alone is compared.
        code = compiled.asm["ptx"].split(".section\t.debug")[0]
        lines = [line.strip() for line in code.splitlines()]
        lines = [line for line in lines if line and not line.startswith(("//", ".loc", ".file"))]
        print("    ptx", hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12])


def main_loop(cubin: bytes) -> str:
    """The K loop in the SASS: the shortest loop (a backward branch's span) that holds the MMAs,
    or the longest loop where no loop holds one (the GEMVs); its instruction count and most
    frequent opcodes. The shortest, because the NVFP4 kernels' slots route wraps its K loop in a
    pair loop (T 1 gate_up: 885 instructions with it, 509 in the K loop itself); on the sorted
    route with tails it is the loop of the blocks without one (the tail's loop adds its dots)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run(
            [str(tool), "-sass", str(path)], capture_output=True, text=True, check=False
        ).stdout
    code = re.findall(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+ )?[A-Z][A-Z0-9_.]*)([^;]*);", sass)
    addrs = [int(addr, 16) for addr, _, _ in code]  # ascending, as cuobjdump prints them
    opcodes = [op.split()[-1].split(".")[0] for _, op, _ in code]
    loops = []
    for i, (_, op, rest) in enumerate(code):
        target = re.search(r"0x([0-9a-f]+)", rest) if op.split()[-1].startswith("BRA") else None
        if target and int(target[1], 16) < addrs[i]:
            loops.append(opcodes[bisect.bisect_left(addrs, int(target[1], 16)) : i + 1])
    if not loops:
        return "no loop found"
    mma = [ops for ops in loops if {"HGMMA", "HMMA"} & set(ops)]
    ops = min(mma, key=len) if mma else max(loops, key=len)
    top = Counter(ops).most_common(8)
    # A synchronous global load in a pipelined loop waits out its latency every step.
    loads = f"{ops.count('LDG')} synchronous global loads, {ops.count('LDGSTS')} async copies"
    summary = ", ".join(f"{op} {n}" for op, n in top)
    kind = "K loop" if mma else "main loop"
    return f"{kind} {len(ops)} instructions ({loads}): {summary}"


if __name__ == "__main__":
    main()
