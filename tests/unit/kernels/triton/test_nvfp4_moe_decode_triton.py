"""The NVFP4 decode helpers (m3serve.kernels.triton.nvfp4_moe.decode) on their own.

The GPU decodes nibbles with inline PTX, which the interpreter cannot run: `test_e2m1_ptx_*`
execute that PTX text on a small emulator of its four instructions, for every byte and a sweep of
scales, against `unpack_e2m1`. The activations' MMA K order is checked against the order the
decoded weight tiles come in, in Triton's interpreter.
"""

from __future__ import annotations

import struct

import pytest
import torch
import triton
import triton.language as tl
from helpers.devices import DEVICE

from m3serve.kernels.quant import unpack_e2m1
from m3serve.kernels.triton.nvfp4_moe import decode

# ----------------------------------------------------------------------- the GPU's PTX decode


def _bf16_bits_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _float_to_bf16_bits(value: float) -> int:
    """Round-to-nearest-even fp32 -> bf16 (products here are exact, so rounding never acts)."""
    (u,) = struct.unpack("<I", struct.pack("<f", value))
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:  # sign-replicate mode: the PTX never uses it
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def run_ptx(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """Execute the decode PTX (prmt / and / mul.lo.u32 / mul.rn.bf16x2 on .b32) on ints."""
    regs: dict[str, int] = {f"${k}": v for k, v in operands.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = [s.strip() for s in rest.split(",")]
        if op == "prmt.b32":
            res = _prmt(val(srcs[0]), val(srcs[1]), val(srcs[2]))
        elif op == "and.b32":
            res = val(srcs[0]) & val(srcs[1])
        elif op == "mul.lo.u32":
            res = (val(srcs[0]) * val(srcs[1])) & 0xFFFFFFFF
        elif op == "mul.rn.bf16x2":
            a, b = val(srcs[0]), val(srcs[1])
            halves = [
                _float_to_bf16_bits(
                    _bf16_bits_to_float(a >> (16 * h)) * _bf16_bits_to_float(b >> (16 * h))
                )
                for h in range(2)
            ]
            res = halves[0] | (halves[1] << 16)
        else:
            raise AssertionError(f"the emulator does not know {op}")
        regs[dst] = res & 0xFFFFFFFF
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$") and int(k[1:]) < 4}


def _boosted(scale: float) -> int:
    """What `_group_scales` feeds the PTX: bf16(e4m3 scale * 2^119)."""
    return _float_to_bf16_bits(scale * 2.0**119)


@pytest.mark.parametrize(
    "scale", [0.0, 2.0**-9, 3 * 2.0**-9, 2.0**-6, 0.8125, 1.0, 13.0, 240.0, 448.0]
)
def test_e2m1_ptx_decodes_every_byte(scale: float) -> None:
    assert float(torch.tensor(scale).to(torch.float8_e4m3fn).float()) == scale
    table = unpack_e2m1(torch.arange(256, dtype=torch.uint8)).view(256, 2)
    asm = decode.E2M1_PTX.value
    s_reg = _boosted(scale) | (_boosted(scale) << 16)
    for start in range(0, 256, 4):
        packed = sum(b << (8 * i) for i, b in enumerate(range(start, start + 4)))
        out = run_ptx(asm, {4: packed, 5: s_reg, 6: s_reg})
        for i, byte in enumerate(range(start, start + 4)):
            reg, half = divmod(i, 2)
            lo = _bf16_bits_to_float(out[reg] >> (16 * half))
            hi = _bf16_bits_to_float(out[2 + reg] >> (16 * half))
            want_lo, want_hi = (float(v) * scale * 2.0**-7 for v in table[byte])
            assert lo == want_lo and hi == want_hi, (byte, scale, lo, hi)


def test_e2m1_ptx_keeps_bytes_apart() -> None:
    """Each byte of a pack decodes on its own: neighbours with every bit set change nothing."""
    asm = decode.E2M1_PTX.value
    one = _boosted(1.0) | (_boosted(1.0) << 16)
    for byte in range(256):
        for pos in range(4):
            noisy = 0xFFFFFFFF & ~(0xFF << (8 * pos)) | (byte << (8 * pos))
            clean = byte << (8 * pos)
            a = run_ptx(asm, {4: noisy, 5: one, 6: one})
            b = run_ptx(asm, {4: clean, 5: one, 6: one})
            reg, half = divmod(pos, 2)
            for r in (reg, 2 + reg):
                assert (a[r] >> (16 * half)) & 0xFFFF == (b[r] >> (16 * half)) & 0xFFFF


# ------------------------------------------------------------------ the activations' K order


@triton.jit
def _k_order_probe(cols_ptr, where_ptr, source_ptr, TILE_K: tl.constexpr):
    """Column numbers in the order the decoded even/odd weight tiles come in (`_mma_k_order` of
    the even, then of the odd columns), where `mma_k_position` puts each column, and which
    column `mma_k_source` takes for each position."""
    HALF: tl.constexpr = TILE_K // 2
    cols = tl.arange(0, TILE_K)
    even, odd = tl.split(tl.reshape(cols, [HALF, 2]))
    even = tl.reshape(decode._mma_k_order(tl.reshape(even, [1, HALF]), 1, HALF), [HALF])
    odd = tl.reshape(decode._mma_k_order(tl.reshape(odd, [1, HALF]), 1, HALF), [HALF])
    tl.store(cols_ptr + tl.arange(0, HALF), even)
    tl.store(cols_ptr + HALF + tl.arange(0, HALF), odd)
    tl.store(where_ptr + cols, decode.mma_k_position(cols, TILE_K))
    tl.store(source_ptr + cols, decode.mma_k_source(cols, TILE_K))


@pytest.mark.parametrize("tile_k", [32, 64, 128])
def test_activations_are_stored_where_the_decoded_weights_expect_them(tile_k: int) -> None:
    """Position p of a K tile of activations holds the column the weight tile's position p came
    from, so the two operands of each dot agree."""
    order = torch.empty(tile_k, dtype=torch.int32, device=DEVICE)
    where = torch.empty(tile_k, dtype=torch.int32, device=DEVICE)
    source = torch.empty(tile_k, dtype=torch.int32, device=DEVICE)
    _k_order_probe[(1,)](order, where, source, TILE_K=tile_k)
    order, where, source = order.cpu(), where.cpu(), source.cpu()
    assert sorted(where.tolist()) == list(range(tile_k)), "a permutation of the tile"
    assert torch.equal(where[order.long()], torch.arange(tile_k, dtype=torch.int32))
    assert torch.equal(source, order), "mma_k_source inverts mma_k_position"
