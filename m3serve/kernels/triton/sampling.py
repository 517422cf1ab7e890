"""Token sampling in Triton: greedy, temperature, top-k, top-p and min-p without sorting the vocab.

Semantics are those of `m3serve.kernels.sampling` (the torch `Sampler`, after penalties): rows
with temperature 0 or top_k 1 take the argmax (the first index among equal maxima, like
`torch.argmax`); the others sample softmax(logits / T) restricted to the kept set, which is
the intersection of

* top-k: tokens whose probability is at least the k-th largest (top_k <= 0 or >= V: off),
* min-p: tokens whose probability is at least min_p times the largest,
* top-p: within the two above, the smallest set of most probable tokens whose mass reaches
  top_p of their mass (the most probable token always stays; top_p >= 1: off).

Ties at a cut-off are all kept. The reference's top-k and min-p keep ties too; its top-p keeps
the tied tokens that its stable sort puts first, so where tokens tie exactly at the top-p
boundary this kernel keeps a superset of the reference's set (the whole tied group). Without
such ties the sets are equal, up to the float rounding of the probabilities themselves.

The race's noise for token j is Philox-4x32-10 under the row's seed at counter
(j // 4, offset low word, offset high word, 0), output j % 4. It depends only on (seed,
offset, token id), so a request's draws are reproducible and independent of the batch, the
tile size and the path its row takes; the caller advances `offsets` by one per step. Draws
differ from the torch sampler's generator stream; their distribution and the kept set are the
same.

Grids depend only on the batch size (and, for `sample`, the chunks a row is spread over, a
function of the batch size and the vocab) and nothing reads the device from the host, so both
entry points can be captured in a CUDA graph.

The kernels and how a row is sampled: `sampling_kernels.py`. On the GPU a row's passes over
the vocab are spread over several programs unless the batch alone fills the SMs
(`sampling_chunks.py`): one program a row reads at what one SM pulls, and over M3.1's 200064
tokens a top-k 50 row took 274 µs against 37 spread over 32 programs (batch 1, an H100).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from m3serve.kernels.triton.attention.config import sm_count
from m3serve.kernels.triton.sampling_chunks import (
    chunk_finish_kernel,
    chunk_gather_kernel,
    chunk_hist_kernel,
    chunk_max_kernel,
)
from m3serve.kernels.triton.sampling_kernels import greedy_kernel, sample_kernel

DEFAULT_BLOCK = 8192
DEFAULT_CANDIDATES = 16384
DEFAULT_NUM_WARPS = 16
# Rows spread over chunks (`sampling_chunks.py`): programs to aim for per SM, the most chunks a
# row takes, and their vocab tile and warps.
_CHUNK_PROGRAMS_PER_SM = 2
MAX_CHUNKS = 32
CHUNK_BLOCK = 2048
CHUNK_NUM_WARPS = 8
# Tile of the candidate search and race; the search holds [pivots, CAND_BLOCK] in registers.
_CAND_BLOCK = 512


def _check_logits(logits: Tensor, block: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise TypeError(f"logits must be float32, got {logits.dtype}")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous in the vocab dimension")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    # Token ids and tile offsets are int32 in the kernels.
    if logits.shape[1] >= 2**31 - 2 * block:
        raise ValueError(f"vocab of {logits.shape[1]} is too large")


def _warps(block: int, num_warps: int) -> int:
    # Every thread owns at least one element of a tile: no replicated lanes, which some
    # Triton versions' tl.histogram would count more than once.
    return max(1, min(num_warps, block // 32))


def _out_tensor(out: Tensor | None, batch: int, device: torch.device) -> Tensor:
    if out is None:
        return torch.empty(batch, dtype=torch.int64, device=device)
    if out.shape != (batch,) or out.dtype != torch.int64 or out.device != device:
        raise ValueError(f"out must be int64 [{batch}] on {device}")
    return out


def _per_row(t: Tensor, name: str, batch: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    if t.shape != (batch,):
        raise ValueError(f"{name} must have shape [{batch}], got {tuple(t.shape)}")
    # A no-op when dtype and device already match; otherwise a copy queued on the stream
    # (never a host sync).
    return t.to(device=device, dtype=dtype).contiguous()


def greedy(
    logits: Tensor,
    out: Tensor | None = None,
    *,
    block: int = DEFAULT_BLOCK,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> Tensor:
    """The argmax of each row of logits [B, V] float32, as int64 [B]: the first index among
    equal maxima, like `torch.argmax` (but NaNs are skipped rather than winning)."""
    _check_logits(logits, block)
    batch, vocab = logits.shape
    out = _out_tensor(out, batch, logits.device)
    if batch > 0:
        greedy_kernel[(batch,)](
            logits, logits.stride(0), out, vocab, BLOCK=block, num_warps=_warps(block, num_warps)
        )
    return out


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    offsets: Tensor,
    out: Tensor | None = None,
    *,
    kept_floor: Tensor | None = None,
    block: int | None = None,
    candidates: int = DEFAULT_CANDIDATES,
    num_warps: int | None = None,
    chunks: int | None = None,
) -> Tensor:
    """One token per row of logits [B, V] float32 (already penalized), as int64 [B].

    Per row: temperature [B] float32 (<= 0: greedy), top_k [B] int32 (<= 0 or >= V: off;
    1: greedy), top_p [B] float32 (>= 1: off), min_p [B] float32 (<= 0: off), and the
    request's random stream, seeds [B] int64 and offsets [B] int64 (advance the offset by one
    per draw). A row's token depends only on its own logits, knobs, seed and offset.

    kept_floor, if given (float32 [B]), receives the smallest logit in each row's kept set:
    the set is every token whose logit is >= it (for a greedy row, the max logit). `block`
    (vocab tile), `candidates` (scratch list length per row), `num_warps` and `chunks`
    (programs a row's passes are spread over, a power of two; by default enough to give every
    SM two programs, one a row on the CPU) tune speed only; the tokens drawn do not depend on
    them.
    """
    # The widest default tile bounds the vocab the strictest.
    _check_logits(logits, block or DEFAULT_BLOCK)
    batch, vocab = logits.shape
    if chunks is None:
        chunks = _auto_chunks(batch, vocab, block or CHUNK_BLOCK, logits.device)
    if chunks < 1 or chunks & (chunks - 1) or chunks > MAX_CHUNKS:
        raise ValueError(f"chunks must be a power of two in [1, {MAX_CHUNKS}], got {chunks}")
    single = chunks == 1
    block = block or (DEFAULT_BLOCK if single else CHUNK_BLOCK)
    device = logits.device
    if candidates < 1:
        raise ValueError(f"candidates must be >= 1, got {candidates}")
    out = _out_tensor(out, batch, device)
    if kept_floor is not None and (
        kept_floor.shape != (batch,)
        or kept_floor.dtype != torch.float32
        or kept_floor.device != device
    ):
        raise ValueError(f"kept_floor must be float32 [{batch}] on {device}")
    if batch == 0:
        return out
    knobs = (
        _per_row(temperature, "temperature", batch, torch.float32, device),
        _per_row(top_k, "top_k", batch, torch.int32, device),
        _per_row(top_p, "top_p", batch, torch.float32, device),
        _per_row(min_p, "min_p", batch, torch.float32, device),
        _per_row(seeds, "seeds", batch, torch.int64, device),
        _per_row(offsets, "offsets", batch, torch.int64, device),
    )
    floor = out if kept_floor is None else kept_floor
    if single:
        # Scratch candidate lists, each written and read by its own row's program only.
        ids = torch.empty((batch, candidates), dtype=torch.int32, device=device)
        xs = torch.empty((batch, candidates), dtype=torch.float32, device=device)
        sample_kernel[(batch,)](
            logits, logits.stride(0), *knobs, out, floor, ids, xs, vocab, candidates,
            BLOCK=block, CAND_BLOCK=min(block, _CAND_BLOCK), WRITE_FLOOR=kept_floor is not None,
            num_warps=_warps(min(block, _CAND_BLOCK), num_warps or DEFAULT_NUM_WARPS),
        )  # fmt: skip
    else:
        _sample_chunked(logits, knobs, out, floor, kept_floor is not None, block, candidates,
                        num_warps or CHUNK_NUM_WARPS, chunks)  # fmt: skip
    return out


def _auto_chunks(batch: int, vocab: int, block: int, device: torch.device) -> int:
    """Chunks a row from shapes: ~2 programs an SM in all, at least one tile a chunk."""
    if device.type != "cuda" or batch == 0:
        return 1
    sms = sm_count(device.index or 0)
    wanted = triton.next_power_of_2(-(-_CHUNK_PROGRAMS_PER_SM * sms // batch))
    tiles = -(-vocab // block)
    most = triton.next_power_of_2(tiles + 1) // 2  # the largest power of two <= tiles
    return max(1, min(wanted, most, MAX_CHUNKS))


def _sample_chunked(
    logits: Tensor,
    knobs: tuple[Tensor, ...],
    out: Tensor,
    floor: Tensor,
    write_floor: bool,
    block: int,
    candidates: int,
    num_warps: int,
    chunks: int,
) -> None:
    """The four launches of `sampling_chunks.py` over a [batch, chunks] grid."""
    batch, vocab = logits.shape
    device = logits.device
    filters, stream = knobs[:4], knobs[4:]
    # A chunk's region holds twice its share of the candidates by its tiles (the last tiles of
    # a row leave some chunks one tile short): rows rarely cluster theirs in one chunk (the
    # tiles are interleaved), and one that does takes the whole-row path instead.
    tiles = -(-vocab // block)
    cap = -(-2 * candidates * -(-tiles // chunks) // tiles)
    parts = batch * chunks
    # Per chunk: its max, mass, race score and smallest logit; its first index at the max,
    # candidate count, race winner and histogram; its candidates, and the row's list of them.
    # Two allocations (each costs the step's host a few µs), cut at multiples of 16 bytes:
    # Triton specializes on a pointer's 16-byte alignment, and a misaligned piece would compile
    # another variant after the warm-up.
    one, lists = _aligned(parts), [_aligned(parts * cap)] * 2
    sizes = [one] * 3 + [one * 32, *lists]
    ints = torch.empty(sum(sizes), dtype=torch.int32, device=device)
    floats = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    parg, pcount, ptoken, phist, ids, list_ids = ints.split(sizes)
    pmax, pmass, pscore, plow, xs, list_xs = floats.split(sizes)
    grid = (batch, chunks)
    consts = {"CHUNKS_PAD": MAX_CHUNKS, "BLOCK": block}
    warps = _warps(block, num_warps)
    rows = (logits, logits.stride(0))
    chunk_max_kernel[grid](*rows, *filters, pmax, parg, vocab, chunks, **consts, num_warps=warps)
    chunk_hist_kernel[grid](
        *rows, *filters, pmax, phist, pmass, vocab, chunks, **consts, num_warps=warps
    )
    chunk_gather_kernel[grid](
        *rows, *filters, *stream, pmax, phist, pmass, pcount, pscore, ptoken, plow, ids, xs,
        vocab, cap, chunks, **consts, num_warps=warps,
    )  # fmt: skip
    chunk_finish_kernel[(batch,)](
        *rows, *filters, *stream, out, floor, pmax, parg, phist, pmass, pcount, pscore, ptoken,
        plow, ids, xs, list_ids, list_xs, vocab, cap, chunks, **consts,
        CAND_BLOCK=min(block, _CAND_BLOCK), WRITE_FLOOR=write_floor,
        num_warps=_warps(min(block, _CAND_BLOCK), DEFAULT_NUM_WARPS),
    )  # fmt: skip


def _aligned(elements: int) -> int:
    """4-byte elements, rounded up to whole 16 bytes."""
    return -(-elements // 4) * 4


def warm_up(vocab: int, device: torch.device) -> None:
    """Compile both ways `sample` draws a batch over this vocab (one program a row, and rows
    spread over chunks: which one depends on the batch size), so that no batch size met
    after start-up compiles a kernel. The chunked kernels do not specialize on the chunk
    count, so one call compiles them for every batch."""
    logits = torch.zeros(1, vocab, device=device)
    knobs = (
        torch.ones(1, device=device),
        torch.full((1,), 40, dtype=torch.int32, device=device),
        torch.full((1,), 0.9, device=device),
        torch.zeros(1, device=device),
        torch.zeros(1, dtype=torch.int64, device=device),
        torch.zeros(1, dtype=torch.int64, device=device),
    )
    for chunks in (1, 2):
        sample(logits, *knobs, chunks=chunks)
