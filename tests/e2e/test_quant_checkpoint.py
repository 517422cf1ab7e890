"""Acceptance: a `--quant modelopt-mixed` tiny checkpoint loads bit-exactly and generates like
transformers running on its dequantized float32 copy.

Every quantized tensor is decoded here from the raw safetensors bytes with numpy bit arithmetic
(no m3serve.kernels.quant, no torch float8), and the checkpoint-name -> fused-parameter rules are
written out here too, so a shared misunderstanding with the loader would show up as a mismatch.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.devices import CPU_REFERENCE
from helpers.param_names import destination, param_block
from safetensors.torch import load_file, save_file

from m3serve.backends.reference import ReferenceBackend
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import LoadedModel, load_model
from m3serve.model.generate import generate
from m3serve.model.kv_cache import KVCache
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

# Same value as conftest's QUANT_SPEC, so the session fixture hands out one shared checkpoint.
QUANT_SPEC = TinySpec(dtype="bfloat16", seed=3, quant="modelopt-mixed")
PREFIX = "language_model."
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
LOGIT_TOLERANCE = 1e-4
NEW_TOKENS = 32


# ------------------------------------------------------------ independent bit-level decoders


def read_raw_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype string, shape, raw little-endian bytes), parsed from the file format."""
    blob = path.read_bytes()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    data = blob[8 + header_len :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = (info["dtype"], tuple(info["shape"]), data[begin:end])
    return out


def e4m3_table() -> np.ndarray:
    """float64 value of every float8_e4m3fn byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits,
    subnormals at exponent 0, NaN at S.1111.111, no infinities."""
    byte = np.arange(256)
    sign = np.where(byte & 0x80, -1.0, 1.0)
    exponent = (byte >> 3) & 0xF
    mantissa = (byte & 0x7).astype(np.float64)
    normal = np.ldexp(1.0 + mantissa / 8.0, exponent - 7)
    subnormal = np.ldexp(mantissa / 8.0, -6)
    value = sign * np.where(exponent == 0, subnormal, normal)
    value[(exponent == 0xF) & ((byte & 0x7) == 0x7)] = np.nan
    return value


def e8m0_table() -> np.ndarray:
    """float64 value of every E8M0 byte: 2**(byte - 127), byte 255 is NaN."""
    value = np.ldexp(1.0, np.arange(256) - 127)
    value[255] = np.nan
    return value


def e2m1_table() -> np.ndarray:
    """float64 value of every 4-bit E2M1 code: bit 3 sign, 2 exponent bits (bias 1), 1 mantissa
    bit, subnormal (0 or 0.5) at exponent 0."""
    code = np.arange(16)
    sign = np.where(code & 0x8, -1.0, 1.0)
    exponent = (code >> 1) & 0x3
    mantissa = (code & 0x1).astype(np.float64)
    value = np.where(exponent == 0, mantissa * 0.5, np.ldexp(1.0 + mantissa / 2.0, exponent - 1))
    return sign * value


E4M3 = e4m3_table()
E8M0 = e8m0_table()
E2M1 = e2m1_table()


def as_u8(raw: tuple[str, tuple[int, ...], bytes]) -> np.ndarray:
    return np.frombuffer(raw[2], dtype=np.uint8).reshape(raw[1])


def plain_value(raw: tuple[str, tuple[int, ...], bytes]) -> np.ndarray:
    """A high-precision tensor as float32 (bf16 is the top half of a float32)."""
    dtype, shape, data = raw
    if dtype == "F32":
        return np.frombuffer(data, dtype="<f4").reshape(shape).copy()
    assert dtype == "BF16", dtype
    halves = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
    return halves.view(np.float32).reshape(shape)


def decode_mxfp8(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """W[n, k] = e4m3(weight[n, k]) * 2**(scale[n, k // 32] - 127); exact in float64."""
    per_element = np.repeat(E8M0[scale], 32, axis=-1)
    return (E4M3[weight] * per_element).astype(np.float32)


def decode_nvfp4(packed: np.ndarray, scale: np.ndarray, scale_2: np.ndarray) -> np.ndarray:
    """W[n, k] = e2m1(nibble[n, k]) * e4m3(scale[n, k // 16]) * scale_2, element 2i in the low
    nibble. The float64 product is exact, so one rounding to float32 equals float32 math."""
    rows = packed.shape[0]
    nibbles = np.stack((packed & 0x0F, packed >> 4), axis=-1).reshape(rows, -1)
    group_scale = np.repeat(E4M3[scale], 16, axis=-1)
    return (E2M1[nibbles] * group_scale * float(scale_2)).astype(np.float32)


def dequantized_tensors(model_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of the checkpoint under its logical name in float32, and the format each
    quantized module was stored in."""
    raw = read_raw_safetensors(model_dir / "model.safetensors")
    out: dict[str, np.ndarray] = {}
    formats: dict[str, str] = {}
    for name in raw:
        if name.endswith(".weight_scale_inv"):
            module = name.removesuffix(".weight_scale_inv")
            weight = raw[f"{module}.weight"]
            assert weight[0] == "F8_E4M3", (module, weight[0])
            out[f"{module}.weight"] = decode_mxfp8(as_u8(weight), as_u8(raw[name]))
            formats[module] = "MXFP8"
        elif name.endswith(".weight_scale"):
            module = name.removesuffix(".weight_scale")
            weight = raw[f"{module}.weight"]
            assert weight[0] == "U8", (module, weight[0])
            scale_2 = plain_value(raw[f"{module}.weight_scale_2"])
            out[f"{module}.weight"] = decode_nvfp4(as_u8(weight), as_u8(raw[name]), scale_2)
            formats[module] = "NVFP4"
    quantized_parts = (".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".input_scale")
    for name, tensor in raw.items():
        module = name.removesuffix(".weight")
        if module in formats or name.endswith(quantized_parts):
            continue
        out[name] = plain_value(tensor)
    return out, formats


# ------------------------------------------------------- checkpoint name -> our parameter


@pytest.fixture(scope="module")
def quant_dir(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(QUANT_SPEC)


@pytest.fixture(scope="module")
def loaded(quant_dir: Path) -> LoadedModel:
    return load_model(quant_dir, CPU_REFERENCE, "float32", progress=False)


@pytest.fixture(scope="module")
def reference(quant_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    return dequantized_tensors(quant_dir)


@pytest.fixture(scope="module")
def fp32_copy(
    quant_dir: Path,
    reference: tuple[dict[str, np.ndarray], dict[str, str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """The checkpoint dequantized: float32 tensors under their logical names, no quant config."""
    tensors, _ = reference
    out = tmp_path_factory.mktemp("dequantized")
    save_file(
        {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in tensors.items()},
        out / "model.safetensors",
    )
    config = json.loads((quant_dir / "config.json").read_text())
    del config["quantization_config"]
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(quant_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def hf_model(fp32_copy: Path):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        fp32_copy, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    # A weight HF failed to map would be randomly initialised and void the comparison.
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    return model.eval()


def prompt(seed: int, length: int, vocab: int = 448) -> list[int]:
    """Random ordinary (non-special) token ids; the top 64 ids of the vocab are specials."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def our_logits(model, ids: list[int]) -> torch.Tensor:
    cfg = model.cfg
    pages = -(-len(ids) // cfg.page_size)
    with torch.inference_mode():
        kv = KVCache.allocate(cfg, pages, torch.float32, "cpu")
        chunk = SeqStep(ids, 0, list(range(pages)))
        batch = ForwardBatch.build([chunk], cfg.page_size, "cpu", all_logits=True)
        return model(batch, kv)


# ---------------------------------------------------------------------------------- tests


def test_checkpoint_really_is_modelopt_mixed(
    reference: tuple[dict[str, np.ndarray], dict[str, str]],
) -> None:
    _, formats = reference
    algos = set(formats.values())
    assert algos == {"MXFP8", "NVFP4"}
    assert all(".experts." in m for m, a in formats.items() if a == "NVFP4")
    assert all(".experts." not in m for m, a in formats.items() if a == "MXFP8")


def test_loaded_weights_equal_independently_dequantized_values_exactly(
    loaded: LoadedModel, reference: tuple[dict[str, np.ndarray], dict[str, str]]
) -> None:
    tensors, formats = reference
    params = dict(loaded.model.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    # The text weights; the (unquantized) vision tower's are checked in tests/unit/model.
    params = {n: p for n, p in params.items() if not n.startswith("vision.")}
    covered = {name: torch.zeros(p.shape, dtype=torch.bool) for name, p in params.items()}
    mismatched = []
    rows = {name: value.shape[0] for name, value in tensors.items() if value.ndim == 2}
    for name, value in tensors.items():
        where = destination(name, rows)
        if where is None:
            continue
        param, expert, half = where
        assert param in params, f"{name} -> {param}: no such parameter"
        got = param_block(params[param].detach(), expert, half)
        if not torch.equal(got, torch.from_numpy(value)):
            mismatched.append(name)
        param_block(covered[param], expert, half).fill_(True)
    assert not mismatched, f"{len(mismatched)} weights differ, e.g. {mismatched[:5]}"
    uncovered = [name for name, mask in covered.items() if not bool(mask.all())]
    assert not uncovered, f"parameters not fully written by any checkpoint weight: {uncovered}"
    # The comparison above really went through both formats.
    quantized = {f"{m}.weight" for m in formats}
    assert sum(1 for n in quantized if destination(n, rows) is not None) == len(formats)


def test_logits_match_transformers_on_dequantized_copy_at_every_position(
    loaded: LoadedModel, hf_model
) -> None:
    ids = prompt(seed=11, length=45)  # 12 blocks of 4 (last one partial): top-3 drops blocks
    ours = our_logits(loaded.model, ids)
    with torch.inference_mode():
        theirs = hf_model(input_ids=torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape == (len(ids), QUANT_SPEC.vocab_size)
    error = (ours - theirs).abs().amax(dim=-1)
    assert float(error.max()) <= LOGIT_TOLERANCE, f"per-position max |delta|: {error.tolist()}"
    # Not trivially equal: logits are well spread, so the bound is meaningful.
    assert float(theirs.std()) > 0.1


@pytest.mark.parametrize(("seed", "length"), [(21, 7), (22, 18), (23, 41)])
def test_greedy_generation_matches_transformers_on_dequantized_copy(
    loaded: LoadedModel, hf_model, seed: int, length: int
) -> None:
    ids = prompt(seed, length)
    eos = set(loaded.config.text.eos_token_ids)
    ours = generate(loaded.model, ids, NEW_TOKENS)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    theirs = out[0, len(ids) :].tolist()
    # Both stop right after the first EOS (HF would pad a batch beyond it; this batch is one).
    for tokens in (ours, theirs):
        assert all(t not in eos for t in tokens[:-1])
        assert len(tokens) == NEW_TOKENS or tokens[-1] in eos
    assert ours == theirs
    assert len(ours) >= 1


# ------------------------------------------------------------ weights held as stored


@pytest.fixture(scope="module")
def held(quant_dir: Path) -> LoadedModel:
    """The checkpoint with its quantized weights kept as stored (the hopper backend's way),
    read by the reference ops, which dequantize them per call."""
    backend = ReferenceBackend(torch.device("cpu"), keep_quantized=True)
    return load_model(quant_dir, backend, "float32", progress=False)


def test_quantized_weights_are_held_in_their_stored_dtypes(
    held: LoadedModel, reference: tuple[dict[str, np.ndarray], dict[str, str]]
) -> None:
    _, formats = reference
    params = dict(held.model.named_parameters())
    layer = next(m for m in formats if ".self_attn.q_proj" in m).split(".self_attn.")[0]
    local = layer.removeprefix(PREFIX)
    assert params[f"{local}.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    assert params[f"{local}.self_attn.qkv_proj.weight_scale"].dtype == torch.uint8
    moe = next(m for m in formats if ".experts." in m).split(".experts.")[0].removeprefix(PREFIX)
    assert params[f"{moe}.experts.w13"].dtype == torch.uint8
    assert params[f"{moe}.experts.w13_scale"].dtype == torch.float8_e4m3fn
    assert params[f"{moe}.experts.w13_global"].shape == (QUANT_SPEC.num_experts, 2)
    # Nothing quantized is held dense: its bytes in memory are the checkpoint's (less the
    # activation scales, which W4A16 does not use).
    tensors = {
        n: t for shard in held.path.glob("*.safetensors") for n, t in load_file(shard).items()
    }
    stored = sum(
        t.nbytes
        for n, t in tensors.items()
        if n.rsplit(".", 1)[0] in formats and not n.endswith(".input_scale")
    )
    quantized = (torch.uint8, torch.float8_e4m3fn)
    held_bytes = sum(
        p.nbytes for n, p in params.items() if p.dtype in quantized or n.endswith("_global")
    )
    assert held_bytes == stored


def test_weights_held_quantized_give_the_logits_of_weights_dequantized_at_load(
    held: LoadedModel, loaded: LoadedModel
) -> None:
    ids = prompt(seed=12, length=45)
    assert torch.equal(our_logits(held.model, ids), our_logits(loaded.model, ids))
