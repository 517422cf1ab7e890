"""The engine's sampler: per-request sampling state (penalty counts, seeded generators, draw
steps) for every running slot, and one batched draw per step. A constrained request's grammar
arrives as a token bitmask, applied after the penalties, so that greedy takes the best allowed
token and a draw never lands on a masked one.

Each row's token is independent of the rows beside it: a seeded request gets the same tokens in
any batch. The math is `m3serve.kernels.sampling` (torch) or, on a GPU, the Triton sampler, which
a decode CUDA graph may also run itself with the knobs `graph_knobs` gives it (core/graphs.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import torch

from m3serve.kernels.sampling import (
    MIN_TEMPERATURE,
    apply_penalties,
    apply_token_bitmask,
    filter_probs_batch,
)
from m3serve.model.host_copy import upload, upload_many
from m3serve.runtime.messages import SamplingParams, TokenLogprob

# The device draw's knobs in order (temperature, top_k, top_p, min_p, seed, draw count): each
# one's dtype, and its value in a CUDA graph's padding rows (greedy: temperature 0).
DRAW_KNOBS: tuple[tuple[torch.dtype, float], ...] = (
    (torch.float32, 0.0),
    (torch.int32, 0),
    (torch.float32, 1.0),
    (torch.float32, 0.0),
    (torch.int64, 0),
    (torch.int64, 0),
)
_SEED_MASK = (1 << 64) - 1  # torch generators take a 64-bit seed; a request may send any int
_SEED_MASK_63 = (1 << 63) - 1  # the Triton kernel takes the seed as an int64


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def _triton_sampler():
    try:
        from m3serve.kernels.triton.sampling import sample
    except ImportError:
        return None
    return sample


class Sampler:
    """Sampling state for up to `max_slots` concurrent requests, and batched sampling.

    A slot is a request's row in the state tensors: `start` claims it, `release` frees it.
    `sample` takes one step's logits for some slots and returns their tokens on the device.
    """

    def __init__(
        self,
        max_slots: int,
        vocab_size: int,
        device: torch.device | str,
        *,
        seed: int | None = None,
    ) -> None:
        """`seed` fixes the stream shared by unseeded requests (tests); by default it is random."""
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        # Output-token counts feed frequency / presence; prompt + output membership, repetition.
        self._counts = torch.zeros(max_slots, vocab_size, dtype=torch.int32, device=self.device)
        self._seen = torch.zeros(max_slots, vocab_size, dtype=torch.bool, device=self.device)
        self._params: list[SamplingParams | None] = [None] * max_slots
        self._generators: list[torch.Generator | None] = [None] * max_slots
        self._shared_generator = torch.Generator(device=self.device)
        # On a GPU, draws run in one Triton kernel keyed by (seed, step): no sort of the vocab,
        # and a request's stream depends only on its own seed and step count.
        self._device_draw = _triton_sampler() if self.device.type == "cuda" else None
        self._seeds = [0] * max_slots
        self._steps = [0] * max_slots
        if seed is None:
            self._shared_generator.seed()
        else:
            self._shared_generator.manual_seed(seed & _SEED_MASK)

    def warm_up(self) -> None:
        """Compile the device draw for every batch size it may meet (`sampling.warm_up`)."""
        if self._device_draw is not None:
            from m3serve.kernels.triton.sampling import warm_up

            warm_up(self.vocab_size, self.device)

    @property
    def device_draw(self) -> Callable[..., torch.Tensor] | None:
        """The Triton draw (kernels/triton/sampling.py `sample`), where there is one."""
        return self._device_draw

    @property
    def max_slots(self) -> int:
        return len(self._params)

    # ------------------------------------------------------------------------ slot lifecycle

    @property
    def num_slots(self) -> int:
        return len(self._params)

    def start(
        self,
        slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
    ) -> None:
        """A new request in `slot`: fresh counts, its own generator if it has a seed.

        `output_ids` resumes a request that was retracted and recomputed: its earlier tokens
        count for the penalties again, and a seeded stream continues where it stopped.
        """
        self._check_slot(slot)
        self._params[slot] = params
        self._generators[slot] = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            self._generators[slot] = generator.manual_seed(params.seed & _SEED_MASK)
            if not params.greedy:
                # Each sampled step drew one noise row of the vocabulary's size.
                row = torch.empty(self.vocab_size, device=self.device)
                for _ in range(len(output_ids)):
                    row.exponential_(generator=generator)
        self._seeds[slot] = (
            params.seed & _SEED_MASK_63 if params.seed is not None else secrets.randbits(62)
        )
        self._steps[slot] = len(output_ids)
        if not _has_penalty(params):
            return  # its penalty state is never read: skip the vocab-wide resets and uploads
        self._counts[slot].zero_()
        self._seen[slot].zero_()
        if len(prompt_ids) > 0:  # len, not truth: prompt ids may come as a numpy array
            self._seen[slot].index_fill_(0, self._upload(list(prompt_ids)), True)
        if len(output_ids) > 0:
            ids = self._upload(list(output_ids))
            self._seen[slot].index_fill_(0, ids, True)
            ones = torch.ones_like(ids, dtype=self._counts.dtype)
            self._counts[slot].index_add_(0, ids, ones)

    def release(self, slot: int) -> None:
        """Free `slot`; its tensor rows are left as they are (`start` resets them)."""
        self._check_slot(slot)
        self._params[slot] = None
        self._generators[slot] = None

    def params(self, slot: int) -> SamplingParams | None:
        """The settings of the request in `slot` (None: no request started there)."""
        self._check_slot(slot)
        return self._params[slot]

    def _check_slot(self, slot: int) -> None:
        # Python lists accept negative indices; a negative slot is a caller bug, not row -1.
        if not 0 <= slot < self.max_slots:
            raise IndexError(f"slot {slot} is outside [0, {self.max_slots})")

    def _active(self, slot: int) -> SamplingParams:
        self._check_slot(slot)
        params = self._params[slot]
        if params is None:
            raise ValueError(f"slot {slot} has no request (start it first)")
        return params

    # ------------------------------------------------------------------------------ sampling

    def sample(
        self,
        logits: torch.Tensor,
        slots: Sequence[int],
        allowed: torch.Tensor | None = None,
        slots_t: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[TokenLogprob | None]]:
        """Tokens [B] (int64, on the device) for logits [B, V] whose row i belongs to slots[i],
        plus a TokenLogprob for each row that asks for logprobs (None elsewhere). `allowed` is
        a packed token bitmask [B, ceil(V/32)] (grammars), on any device; `slots_t`, the slots
        already on the device (int64), if the caller has them.

        Nothing here reads the device from the host unless some row wants logprobs.
        """
        params = self._batch_params(logits, slots)
        if not params:
            return torch.empty(0, dtype=torch.int64, device=self.device), []
        logits = logits.float()
        if slots_t is None:
            slots_t = self._upload(list(slots))
        penalized = self._penalize(logits, slots_t, params)
        if allowed is not None:
            penalized = apply_token_bitmask(penalized, allowed.to(self.device))
        if all(p.greedy for p in params):
            tokens = torch.argmax(penalized, dim=-1)
        else:
            tokens = self._sample_mixed(penalized, list(slots), params)
        logprobs = self._logprobs(logits, tokens, params)
        self._record(slots_t, tokens, params)
        return tokens, logprobs

    def penalized(self, logits: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
        """The logits [B, V] after each slot's penalties, as `sample` would use them."""
        params = self._batch_params(logits, slots)
        if not params:
            return logits.float()
        return self._penalize(logits.float(), self._upload(list(slots)), params)

    def _batch_params(self, logits: torch.Tensor, slots: Sequence[int]) -> list[SamplingParams]:
        if logits.dim() != 2 or logits.shape != (len(slots), self.vocab_size):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(slots)} slots x "
                f"vocab {self.vocab_size}"
            )
        return self._slot_params(slots)

    def _slot_params(self, slots: Sequence[int]) -> list[SamplingParams]:
        """Each slot's settings; every slot once and started."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in {list(slots)}")
        return [self._active(slot) for slot in slots]

    def _penalize(
        self, logits: torch.Tensor, slots_t: torch.Tensor, params: list[SamplingParams]
    ) -> torch.Tensor:
        rows = [i for i, p in enumerate(params) if _has_penalty(p)]
        if not rows:
            return logits
        penalties = [params[i] for i in rows]
        knobs = self._upload(
            [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in penalties],
            torch.float32,
        )
        if len(rows) == len(params):
            return self._penalize_rows(logits, slots_t, knobs)
        # Only the penalized rows pay for gathering their [V] state.
        rows_t = self._upload(rows)
        penalized = self._penalize_rows(
            logits.index_select(0, rows_t), slots_t.index_select(0, rows_t), knobs
        )
        return logits.index_copy(0, rows_t, penalized)

    def _penalize_rows(
        self, logits: torch.Tensor, slots_t: torch.Tensor, knobs: torch.Tensor
    ) -> torch.Tensor:
        seen = self._seen.index_select(0, slots_t)
        counts = self._counts.index_select(0, slots_t)
        return apply_penalties(logits, seen, counts, *knobs.unbind(1))

    def _sample_mixed(
        self, logits: torch.Tensor, slots: list[int], params: list[SamplingParams]
    ) -> torch.Tensor:
        """Greedy rows take the argmax, the others a draw."""
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(rows) == len(params):
            return self._draw(logits, slots, params)
        rows_t = self._upload(rows)
        drawn = self._draw(
            logits.index_select(0, rows_t), [slots[i] for i in rows], [params[i] for i in rows]
        )
        return torch.argmax(logits, dim=-1).index_copy(0, rows_t, drawn)

    def _draw(
        self, logits: torch.Tensor, slots: list[int], params: list[SamplingParams]
    ) -> torch.Tensor:
        """Temperature, top-k / min-p / top-p, then the exponential race, for non-greedy rows."""
        if self._device_draw is not None:
            return self._draw_on_device(logits, slots, params)
        vocab = self.vocab_size
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        # One upload for all knobs; top_k rides as a float, exact for any vocab below 2**24.
        knobs = self._upload(
            [
                [max(p.temperature, MIN_TEMPERATURE), p.top_p, p.min_p, k]
                for p, k in zip(params, top_ks, strict=True)
            ],
            torch.float32,
        )
        probs = torch.softmax(logits / knobs[:, :1], dim=-1)
        # Skip the sort when no row cuts anything.
        if any(k < vocab for k in top_ks) or any(p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            probs = filter_probs_batch(probs, knobs[:, 3].long(), knobs[:, 1], knobs[:, 2])
        # argmax(p / E) with E ~ Exp(1) is a draw from p / sum(p): no renormalizing, no cumsum.
        return torch.argmax(probs / self._race_noise(probs, slots), dim=-1)

    def _draw_on_device(
        self, logits: torch.Tensor, slots: list[int], params: list[SamplingParams]
    ) -> torch.Tensor:
        assert self._device_draw is not None
        # One copy up, each knob its own contiguous view in the dtype the kernel takes (no
        # column copies or casts on the device: each was a kernel launch a step).
        dtypes = [dtype for dtype, _ in DRAW_KNOBS]
        knobs = upload_many(list(zip(self._knobs(slots, params), dtypes, strict=True)), self.device)
        return self._device_draw(logits.contiguous(), *knobs)

    def graph_knobs(self, slots: Sequence[int], rows: int) -> list[list[int] | list[float]] | None:
        """The device draw's knobs (`DRAW_KNOBS`) for a CUDA graph that samples `rows` rows
        itself (core/graphs.py), the slots' rows first, then padding; the slots' draws are
        counted as `sample` counts them. None where a row needs what only `sample` does:
        penalties, logprobs, or no device draw at all (a grammar's mask: the caller's check)."""
        if self._device_draw is None or len(slots) > rows:
            return None
        params = self._slot_params(slots)
        if any(p.logprobs or _has_penalty(p) for p in params):
            return None
        pad = rows - len(slots)
        knobs = self._knobs(slots, params)
        for knob, (_, fill) in zip(knobs, DRAW_KNOBS, strict=True):
            knob.extend([fill] * pad)  # type: ignore[list-item]
        return knobs

    def _knobs(
        self, slots: Sequence[int], params: list[SamplingParams]
    ) -> list[list[int] | list[float]]:
        """Each row's temperature, top_k, top_p, min_p, seed and draw count, as the device draw
        takes them; a sampled row's draw count goes up by one (greedy rows draw no noise)."""
        steps = [self._steps[s] for s in slots]
        for slot, p in zip(slots, params, strict=True):
            if not p.greedy:
                self._steps[slot] += 1
        return [
            [p.temperature for p in params],
            [max(p.top_k, 0) for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            [self._seeds[s] for s in slots],
            steps,
        ]

    def _race_noise(self, probs: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Exp(1) noise shaped like probs [n, V]. A seeded slot fills its row from its own
        generator, one row per call, so its stream depends on nothing but its own steps."""
        noise = torch.empty_like(probs)
        shared = [i for i, slot in enumerate(slots) if self._generators[slot] is None]
        if len(shared) == len(slots):
            noise.exponential_(generator=self._shared_generator)
        elif shared:
            block = torch.empty((len(shared), probs.shape[1]), device=probs.device)
            block.exponential_(generator=self._shared_generator)
            noise.index_copy_(0, self._upload(shared), block)
        for i, slot in enumerate(slots):
            generator = self._generators[slot]
            if generator is not None:
                noise[i].exponential_(generator=generator)
        # A zero draw would make 0 / 0 = NaN for a filtered-out token, and NaN wins argmax.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    # ------------------------------------------------------------------------------ logprobs

    def _logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> list[TokenLogprob | None]:
        """Raw logprobs (log_softmax before penalties and temperature) for rows that ask."""
        out: list[TokenLogprob | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs]
        if not rows:
            return out
        rows_t = self._upload(rows)
        logprobs = torch.log_softmax(logits.index_select(0, rows_t), dim=-1)
        chosen = tokens.index_select(0, rows_t).unsqueeze(1)
        width = min(max(params[i].top_logprobs for i in rows), self.vocab_size)
        top = torch.topk(logprobs, width, dim=-1)  # sorted, highest first
        # One float64 matrix, so the host waits for a single copy; ids are exact below 2**53.
        # Convert before cat: cat would promote the ids to float32, inexact past 2**24.
        parts = [chosen, logprobs.gather(1, chosen), top.indices, top.values]
        packed = torch.cat([part.to(torch.float64) for part in parts], dim=1)
        for i, row in zip(rows, packed.tolist(), strict=True):
            n = min(params[i].top_logprobs, width)
            ids, values = row[2 : 2 + n], row[2 + width : 2 + width + n]
            top_pairs = [(int(t), v) for t, v in zip(ids, values, strict=True)]
            out[i] = TokenLogprob(int(row[0]), row[1], top_pairs)
        return out

    # ----------------------------------------------------------------------------- utilities

    def _record(
        self, slots_t: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> None:
        """Count this step's tokens into the state of the slots whose requests have penalties
        (no other request reads it): one scatter each, on the device. A slot appears once per
        step, so the flat indices are distinct and the add is exact in any order."""
        rows = [i for i, p in enumerate(params) if _has_penalty(p)]
        if not rows:
            return
        flat = slots_t * self.vocab_size + tokens
        if len(rows) < len(params):
            flat = flat.index_select(0, self._upload(rows))
        self._counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        self._seen.view(-1).index_fill_(0, flat, True)

    def _upload(
        self, values: list[int] | list[list[float]], dtype: torch.dtype = torch.int64
    ) -> torch.Tensor:
        """A small host list as a device tensor, without syncing."""
        return upload(values, dtype, self.device)
