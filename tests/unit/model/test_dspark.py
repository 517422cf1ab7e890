"""The DSpark draft network (model-m3.md §D.2) at the model level: it loads from a tiny
checkpoint's `dspark/` (BF16 and ModelOpt-mixed MXFP8), shares the target's embedding and LM
head, proposes one block of 7 tokens with the documented shapes, and its masks and Markov head
behave as §D.2 says; one draft layer's attention is re-derived from §D in plain torch."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from m3serve.backends.reference import ReferenceBackend
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import LoadedModel, load_model
from m3serve.model.config import ConfigError
from m3serve.model.dspark import DSparkDraft, target_features
from m3serve.model.dspark_config import parse_dspark_config
from m3serve.model.dspark_loader import draft_inventory, load_dspark
from m3serve.model.kv_cache import KVCache
from m3serve.model.loader import CheckpointError
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

F32 = TinySpec(dtype="float32", seed=11, dspark=True)
BF16 = TinySpec(dtype="bfloat16", seed=12, dspark=True)
MIXED = TinySpec(dtype="bfloat16", seed=13, dspark=True, quant="modelopt-mixed")
CPU = torch.device("cpu")
PREFIX = "language_model.model.dspark."

MakeCheckpoint = Callable[[TinySpec], Path]


def _load(path: Path, keep_quantized: bool = False) -> tuple[LoadedModel, DSparkDraft]:
    backend = ReferenceBackend(CPU, keep_quantized=keep_quantized)
    target = load_model(path, backend, progress=False)
    return target, load_dspark(path, target.model, backend, target.dtype)


@pytest.fixture(scope="module")
def f32(tiny_checkpoint: MakeCheckpoint) -> tuple[Path, LoadedModel, DSparkDraft]:
    path = tiny_checkpoint(F32)
    return (path, *_load(path))


def _features(draft: DSparkDraft, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, draft.cfg.feature_size, generator=g)


@pytest.mark.parametrize("spec", [BF16, MIXED], ids=["bf16", "modelopt-mixed"])
def test_loads_from_dspark_subfolder(tiny_checkpoint: MakeCheckpoint, spec: TinySpec) -> None:
    path = tiny_checkpoint(spec)
    assert (path / "dspark" / "config.json").is_file()
    target, draft = _load(path)
    cfg = draft.cfg
    assert cfg.layers.num_layers == spec.dspark_layers and cfg.block_size == 7
    assert cfg.target_layer_ids[-1] == spec.num_layers - 1
    assert (cfg.quant is not None) == (spec.quant == "modelopt-mixed")
    # The embedding and LM head are the target's, not copies.
    names = {n for n, _ in draft.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
    ids = torch.tensor([1, 2])
    assert torch.equal(draft.shared.embed(ids), target.model.model.embed_tokens.weight[ids])
    ctx = draft.context(_features(draft, 12), torch.arange(12))
    proposal = draft.propose(7, 12, ctx)
    assert torch.isfinite(proposal.logits).all()
    if spec.quant == "modelopt-mixed":
        # Held as stored (MXFP8 codes + scales) it computes the same as dequantized at load.
        _, held = _load(path, keep_quantized=True)
        assert held.layers[0].qkv_proj.weight.dtype == torch.float8_e4m3fn
        again = held.propose(7, 12, held.context(_features(draft, 12), torch.arange(12)))
        torch.testing.assert_close(again.logits, proposal.logits)


def test_proposal_shapes_and_greedy(f32: tuple[Path, LoadedModel, DSparkDraft]) -> None:
    _, target, draft = f32
    ctx = draft.context(_features(draft, 10), torch.arange(10))
    p = draft.propose(3, 10, ctx)
    vocab, hidden = target.config.text.vocab_size, target.config.text.hidden_size
    assert p.tokens.shape == (7,) and p.tokens.dtype == torch.int64
    assert p.logits.shape == (7, vocab) and p.logits.dtype == torch.float32
    assert p.hidden.shape == (7, hidden)
    assert torch.equal(p.tokens, p.logits.argmax(-1))
    assert len(ctx.k) == draft.cfg.layers.num_layers
    assert ctx.k[0].shape == (10, draft.cfg.layers.num_kv_heads, draft.cfg.layers.head_dim)


def test_block_is_anchor_then_noise_and_non_causal(
    f32: tuple[Path, LoadedModel, DSparkDraft],
) -> None:
    _, _, draft = f32
    ctx = draft.context(_features(draft, 10), torch.arange(10))
    seen: list[torch.Tensor] = []
    embed = draft.shared.embed
    base = draft.block_hidden(3, 10, ctx)

    def bumped(ids: torch.Tensor) -> torch.Tensor:
        seen.append(ids.clone())
        out = embed(ids).clone()
        out[5] += 1.0  # a noise slot's input
        return out

    object.__setattr__(draft.shared, "embed", bumped)
    try:
        changed = draft.block_hidden(3, 10, ctx)
    finally:
        object.__setattr__(draft.shared, "embed", embed)
    noise = draft.cfg.noise_token_id
    assert seen[0].tolist() == [3] + [noise] * 6
    # Every slot, also the earlier ones, sees slot 5: attention inside the block is non-causal.
    for slot in range(7):
        assert not torch.allclose(changed[slot], base[slot]), slot


def test_context_at_or_after_anchor_and_outside_window_is_ignored(
    f32: tuple[Path, LoadedModel, DSparkDraft],
) -> None:
    _, _, draft = f32
    window = draft.cfg.sliding_window
    n, anchor = window + 12, window + 8
    feats = _features(draft, n)
    base = draft.propose(4, anchor, draft.context(feats, torch.arange(n)))

    def with_changed(pos: int) -> torch.Tensor:
        other = feats.clone()
        other[pos] = torch.randn(feats.shape[1])
        return draft.propose(4, anchor, draft.context(other, torch.arange(n))).logits

    for pos in (anchor, anchor + 2, anchor - window):  # the anchor, later, older than any window
        torch.testing.assert_close(with_changed(pos), base.logits, rtol=0, atol=0)
    assert not torch.allclose(with_changed(anchor - 1), base.logits)
    assert not torch.allclose(with_changed(anchor - window + 1), base.logits)


def test_markov_head_goes_slot_by_slot(f32: tuple[Path, LoadedModel, DSparkDraft]) -> None:
    _, _, draft = f32
    ctx = draft.context(_features(draft, 9), torch.arange(9))
    p = draft.propose(6, 9, ctx)
    z = draft.shared.logits(p.hidden)
    prev = torch.cat((torch.tensor([6]), p.tokens[:-1]))
    w1, w2 = draft.markov_w1.weight, draft.markov_w2.weight
    torch.testing.assert_close(p.logits, z + w1[prev] @ w2.T)
    # The correction is not a no-op: it changes some slot's choice away from the base argmax.
    assert not torch.equal(p.tokens, z.argmax(-1))


def test_deterministic_greedy_and_seeded_sampling(
    f32: tuple[Path, LoadedModel, DSparkDraft],
) -> None:
    _, _, draft = f32
    ctx = draft.context(_features(draft, 9), torch.arange(9))
    a, b = draft.propose(6, 9, ctx), draft.propose(6, 9, ctx)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)

    def sample(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return draft.propose(6, 9, ctx, temperature=1.0, generator=g).tokens

    assert torch.equal(sample(1), sample(1))
    assert any(not torch.equal(sample(1), sample(s)) for s in range(2, 6))


def test_target_features_are_residual_streams(f32: tuple[Path, LoadedModel, DSparkDraft]) -> None:
    _, target, draft = f32
    cfg = target.config.text
    ids = list(range(5, 25))
    seq = SeqStep(input_ids=ids, start=0, pages=list(range(5)))
    batch = ForwardBatch.build([seq], cfg.page_size, CPU, all_logits=True)
    feats = target_features(target.model, batch, _kv(target), draft.cfg.target_layer_ids)
    assert feats.shape == (len(ids), draft.cfg.feature_size)
    # The last target layer's stream, final-normed, is the target's own final hidden state.
    last = feats[:, -cfg.hidden_size :]
    expected = target.model.hidden_states(batch, _kv(target))
    norm = target.model.model.norm
    torch.testing.assert_close(target.backend.rms_norm(last, norm.weight, norm.eps), expected)


def _kv(target: LoadedModel) -> KVCache:
    return KVCache.allocate(target.config.text, 8, target.dtype, CPU)


def _gemma(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)


def _rope(x: torch.Tensor, pos: torch.Tensor, rot: int) -> torch.Tensor:
    """NeoX rotation of channels [0, rot): pairs (i, i + rot/2), θ_i = p · 5e6^(−2i/rot)."""
    out, half = x.clone(), rot // 2
    for i in range(half):
        angle = pos.double() * 5e6 ** (-2 * i / rot)
        c, s = angle.cos().float()[:, None], angle.sin().float()[:, None]
        a, b = x[..., i], x[..., i + half]
        out[..., i], out[..., i + half] = a * c - b * s, b * c + a * s
    return out


def test_layer_attention_matches_plain_torch(f32: tuple[Path, LoadedModel, DSparkDraft]) -> None:
    """Layer 0's attention output, from the stored tensors and §D.2 steps 1-4 alone."""
    path, target, draft = f32
    raw = load_file(str(path / "dspark" / "model.safetensors"))
    cfg = draft.cfg.layers
    hq, hkv, d, rot = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim
    w = {k.removeprefix(PREFIX + "layers.0.decoder_layer."): v.float() for k, v in raw.items()}
    n, anchor, window = 30, 26, draft.cfg.sliding_window
    feats, ctx_pos = _features(draft, n, seed=3), torch.arange(n)
    ctx = _gemma(feats @ raw[PREFIX + "fc.weight"].float().T, raw[PREFIX + "hidden_norm.weight"])

    def heads(x: torch.Tensor, name: str, count: int) -> torch.Tensor:
        return (x @ w[f"self_attn.{name}_proj.weight"].T).view(len(x), count, d)

    def keys(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return _rope(_gemma(heads(x, "k", hkv), w["self_attn.k_norm.weight"]), pos, rot)

    block_pos = anchor + torch.arange(7)
    ids = torch.tensor([9] + [draft.cfg.noise_token_id] * 6)
    x = _gemma(target.model.model.embed_tokens.weight[ids], w["input_layernorm.weight"])
    q = _rope(_gemma(heads(x, "q", hq), w["self_attn.q_norm.weight"]), block_pos, rot)
    k = torch.cat((keys(ctx, ctx_pos), keys(x, block_pos)))
    v = torch.cat((heads(ctx, "v", hkv), heads(x, "v", hkv)))
    key_pos = torch.cat((ctx_pos, block_pos))
    in_block = torch.arange(len(key_pos)) >= n
    out = torch.empty(7, hq, d)
    for h in range(hq):
        g = h // (hq // hkv)
        for i in range(7):
            ok = in_block | ((key_pos < anchor) & (block_pos[i] - key_pos <= window - 1))
            scores = (k[:, g] @ q[i, h]) / math.sqrt(d)
            probs = torch.softmax(scores.masked_fill(~ok, float("-inf")), dim=0)
            out[i, h] = probs @ v[:, g]
    expected = out.reshape(7, hq * d) @ w["self_attn.o_proj.weight"].T

    context = draft.context(feats, ctx_pos)
    allowed = draft.block_mask(ctx_pos, anchor)
    layer = draft.layers[0]
    got = layer.attend(x, block_pos, context.k[0], context.v[0], allowed, draft.inv_freq)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_config_and_checkpoint_errors(tiny_checkpoint: MakeCheckpoint, tmp_path: Path) -> None:
    path = tiny_checkpoint(F32)
    raw = json.loads((path / "dspark" / "config.json").read_text())
    with pytest.raises(ConfigError, match="architectures"):
        parse_dspark_config({**raw, "architectures": ["Other"]})
    # The released draft's global MXFP8 block: every layer projection MXFP8, fc BF16.
    cfg = parse_dspark_config({**raw, "quantization_config": {"quant_method": "mxfp8"}})
    assert cfg.quant is not None
    algos = {
        s.module.rsplit(".", 1)[-1]: cfg.quant.algo_for(s.module)
        for s in draft_inventory(cfg)
        if s.kind == "linear"
    }
    assert algos["fc"] is None and algos["q_proj"] == algos["down_proj"] == "MXFP8"
    # A draft built for another target, and a draft missing a tensor, are refused.
    backend = ReferenceBackend(CPU)
    target = load_model(path, backend, progress=False)
    bad = tmp_path / "bad"
    bad.mkdir()
    text = {**raw["text_config"], "dspark_target_layer_ids": [0, 99]}
    (bad / "config.json").write_text(json.dumps({**raw, "text_config": text}))
    with pytest.raises(ConfigError, match="outside the target"):
        load_dspark(bad, target.model, backend, target.dtype)
    (bad / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(path / "dspark" / "model.safetensors"))
    del tensors[PREFIX + "hidden_norm.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor .*hidden_norm"):
        load_dspark(bad, target.model, backend, target.dtype)
