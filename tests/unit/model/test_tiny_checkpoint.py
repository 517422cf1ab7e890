"""The tiny checkpoint writer: deterministic output, a config both we and transformers read the
same way, the ModelOpt MIXED_PRECISION layout of the real release, weights that really drive the
SwiGLU clamp, and the once-only, process-safe built-in default model."""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import queue
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.devices import CPU_REFERENCE
from safetensors import safe_open
from safetensors.torch import load_file

from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.config import load_model_config, parse_model_config
from m3serve.model.ffn import DenseMLP, MoE
from m3serve.model.kv_cache import KVCache
from m3serve.model.tiny.checkpoint import TinySpec, make_tiny
from m3serve.model.tiny.default import default_model_path
from m3serve.model.vision.config import vision_config
from m3serve.runtime.messages import SeqStep

# Same values as conftest's specs, so the session fixture shares the checkpoints it writes.
M31_SPEC = TinySpec(dtype="float32", seed=1)
M3_SPEC = TinySpec(dtype="float32", seed=2, num_layers=5, full_attention_layers=2, dense_layers=2)
QUANT_SPEC = TinySpec(dtype="bfloat16", seed=3, quant="modelopt-mixed")
# A small spec for tests that write checkpoints themselves.
SMALL_SPEC = TinySpec(num_layers=2, num_experts=4, seed=7)

MakeCheckpoint = Callable[[TinySpec], Path]
SWIGLU_LIMIT = 7.0
TEXT = "language_model.model."


def tensor_meta(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of a single-file checkpoint."""
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        slices = {name: f.get_slice(name) for name in list(f.keys())}
        return {name: (s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


# -------------------------------------------------------------------------- determinism


def test_same_spec_writes_byte_identical_files(tmp_path: Path) -> None:
    first = make_tiny(tmp_path / "a", SMALL_SPEC)
    second = make_tiny(tmp_path / "b", SMALL_SPEC)
    names = sorted(p.name for p in first.iterdir())
    assert {"config.json", "model.safetensors", "generation_config.json"} <= set(names)
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_same_quantized_sharded_spec_writes_byte_identical_shards(tmp_path: Path) -> None:
    spec = dataclasses.replace(SMALL_SPEC, quant="modelopt-mixed", shards=2)
    first = make_tiny(tmp_path / "a", spec)
    second = make_tiny(tmp_path / "b", spec)
    files = sorted(p.name for p in first.glob("model*"))
    assert len(files) == 3  # two shards and the index
    for name in [*files, "config.json"]:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_different_seed_writes_different_weights(tmp_path: Path) -> None:
    one = read_tensors(make_tiny(tmp_path / "a", SMALL_SPEC))
    other = read_tensors(make_tiny(tmp_path / "b", dataclasses.replace(SMALL_SPEC, seed=8)))
    assert one.keys() == other.keys()
    same = [n for n in one if torch.equal(one[n], other[n])]
    assert not same, f"unchanged by the seed: {same}"


# ------------------------------------------------------------------------------- config


@pytest.mark.parametrize("spec", [M31_SPEC, M3_SPEC], ids=["m3.1", "m3"])
def test_config_parses_the_same_with_ours_and_transformers(
    tiny_checkpoint: MakeCheckpoint, spec: TinySpec
) -> None:
    transformers = pytest.importorskip("transformers")
    path = tiny_checkpoint(spec)
    ours = load_model_config(path).text
    hf = transformers.MiniMaxM3VLConfig.from_pretrained(path).text_config

    expected_attn = ["full"] * spec.full_attention_layers + ["sparse"] * (
        spec.num_layers - spec.full_attention_layers
    )
    expected_mlp = ["dense"] * spec.dense_layers + ["moe"] * (spec.num_layers - spec.dense_layers)
    assert list(ours.layer_types) == expected_attn
    hf_attn = {"full_attention": "full", "minimax_m3_sparse": "sparse"}
    assert [hf_attn[t] for t in hf.layer_types] == expected_attn
    assert list(ours.mlp_layer_types) == expected_mlp
    assert [{"dense": "dense", "sparse": "moe"}[t] for t in hf.mlp_layer_types] == expected_mlp

    assert hf.rope_parameters["partial_rotary_factor"] == 0.5
    assert ours.rotary_dim == ours.head_dim // 2 == hf.head_dim // 2
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    pairs = {
        "index_n_heads": "index_n_heads",
        "index_head_dim": "index_head_dim",
        "index_block_size": "index_block_size",
        "index_topk_blocks": "index_topk_blocks",
        "index_local_blocks": "index_local_blocks",
        "num_experts": "num_local_experts",
        "num_experts_per_tok": "num_experts_per_tok",
        "intermediate_size": "intermediate_size",
        "shared_intermediate_size": "shared_intermediate_size",
        "dense_intermediate_size": "dense_intermediate_size",
        "hidden_size": "hidden_size",
        "vocab_size": "vocab_size",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
        "swiglu_limit": "swiglu_limit",
        "swiglu_alpha": "swiglu_alpha",
        "routed_scaling_factor": "routed_scaling_factor",
    }
    assert {o: getattr(ours, o) for o in pairs} == {o: getattr(hf, h) for o, h in pairs.items()}
    assert (ours.index_n_heads, ours.index_block_size, ours.index_topk_blocks) == (2, 4, 3)
    assert ours.eos_token_ids == (hf.eos_token_id,)


# ------------------------------------------------------------------------ quant layout


def expected_quantized_modules(spec: TinySpec) -> dict[str, str]:
    """Every module the release quantizes, written from model-m3.md C.2/C.3."""
    modules = {}
    for layer in range(spec.num_layers):
        base = f"{TEXT}layers.{layer}."
        projections = ["q_proj", "k_proj", "v_proj", "o_proj"]
        if layer >= spec.full_attention_layers:
            projections += ["index_q_proj", "index_k_proj"]
        for proj in projections:
            modules[f"{base}self_attn.{proj}"] = "MXFP8"
        ffn = (
            f"{base}mlp."
            if layer < spec.dense_layers
            else f"{base}block_sparse_moe.shared_experts."
        )
        for proj in ("gate_proj", "up_proj", "down_proj"):
            modules[ffn + proj] = "MXFP8"
        if layer >= spec.dense_layers:
            for expert in range(spec.num_experts):
                for w in ("w1", "w2", "w3"):
                    modules[f"{base}block_sparse_moe.experts.{expert}.{w}"] = "NVFP4"
    return modules


def logical_shape(spec: TinySpec, module: str) -> tuple[int, int]:
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.dense_intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    width = d if ".mlp." in module else i
    leaf = module.rsplit(".", 1)[1]
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "index_q_proj": (spec.num_kv_heads * spec.index_head_dim, h),
        "index_k_proj": (spec.index_head_dim, h),
        "gate_proj": (width, h),
        "up_proj": (width, h),
        "down_proj": (h, width),
        "w1": (i, h),
        "w3": (i, h),
        "w2": (h, i),
    }[leaf]


def test_quantized_layers_lists_exactly_the_quantized_modules(
    tiny_checkpoint: MakeCheckpoint,
) -> None:
    config = json.loads((tiny_checkpoint(QUANT_SPEC) / "config.json").read_text())
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "MIXED_PRECISION")
    listed = {m: entry["quant_algo"] for m, entry in qc["quantized_layers"].items()}
    assert listed == expected_quantized_modules(QUANT_SPEC)
    assert all(
        entry["group_size"] == 16
        for entry in qc["quantized_layers"].values()
        if entry["quant_algo"] == "NVFP4"
    )
    never = ("embed_tokens", "lm_head", "norm", "block_sparse_moe.gate", "vision", "projector")
    assert not [m for m in listed if any(part in m for part in never)]


def test_quant_checkpoint_stores_the_modelopt_dtypes_and_shapes(
    tiny_checkpoint: MakeCheckpoint,
) -> None:
    meta = tensor_meta(tiny_checkpoint(QUANT_SPEC))
    modules = expected_quantized_modules(QUANT_SPEC)
    for module, algo in modules.items():
        rows, cols = logical_shape(QUANT_SPEC, module)
        if algo == "MXFP8":
            assert meta.pop(f"{module}.weight") == ("F8_E4M3", (rows, cols)), module
            assert meta.pop(f"{module}.weight_scale_inv") == ("U8", (rows, cols // 32)), module
        else:
            assert meta.pop(f"{module}.weight") == ("U8", (rows, cols // 2)), module
            assert meta.pop(f"{module}.weight_scale") == ("F8_E4M3", (rows, cols // 16)), module
            assert meta.pop(f"{module}.weight_scale_2") == ("F32", ()), module
            assert meta.pop(f"{module}.input_scale") == ("F32", ()), module
    # Everything left is high precision: bf16, except the fp32 routing bias.
    text_rest = {n: m for n, m in meta.items() if n.startswith("language_model.")}
    assert text_rest
    for name, (dtype, _) in text_rest.items():
        want = "F32" if name.endswith("e_score_correction_bias") else "BF16"
        assert dtype == want, name
    assert all(dtype == "BF16" for n, (dtype, _) in meta.items() if n not in text_rest)
    names = set(text_rest)
    assert "language_model.lm_head.weight" in names
    assert f"{TEXT}embed_tokens.weight" in names
    assert f"{TEXT}layers.1.block_sparse_moe.gate.weight" in names


def test_w1_and_w3_of_an_expert_share_one_global_scale(tiny_checkpoint: MakeCheckpoint) -> None:
    tensors = read_tensors(tiny_checkpoint(QUANT_SPEC))
    experts = 0
    for layer in range(QUANT_SPEC.dense_layers, QUANT_SPEC.num_layers):
        for expert in range(QUANT_SPEC.num_experts):
            base = f"{TEXT}layers.{layer}.block_sparse_moe.experts.{expert}."
            w1, w2, w3 = (tensors[f"{base}{w}.weight_scale_2"] for w in ("w1", "w2", "w3"))
            assert torch.equal(w1, w3), base
            # The shared scale comes from the joint amax: the group holding it gets scale 448.
            group_scales = torch.cat(
                [tensors[f"{base}{w}.weight_scale"].float().flatten() for w in ("w1", "w3")]
            )
            assert float(group_scales.max()) == 448.0
            # w2 has its own global scale, from its own amax.
            assert float(tensors[f"{base}w2.weight_scale"].float().max()) == 448.0
            assert not torch.equal(w1, w2)
            experts += 1
    assert experts == (QUANT_SPEC.num_layers - QUANT_SPEC.dense_layers) * QUANT_SPEC.num_experts


# ------------------------------------------------------------------- SwiGLU clamp coverage


@pytest.mark.parametrize("spec", [M31_SPEC, QUANT_SPEC], ids=["m3.1", "quant"])
def test_random_weights_drive_swiglu_preactivations_past_the_clamp(
    tiny_checkpoint: MakeCheckpoint, spec: TinySpec
) -> None:
    loaded = load_model(tiny_checkpoint(spec), CPU_REFERENCE, "float32", progress=False)
    model = loaded.model
    cfg = model.cfg
    assert cfg.swiglu_limit == SWIGLU_LIMIT
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_hook(
            lambda _m, args, _out, name=name: inputs.__setitem__(name, args[0].clone())
        )
        for name, module in model.named_modules()
        if isinstance(module, (MoE, DenseMLP)) and "shared_experts" not in name
    ]
    ids = torch.randint(0, 448, (32,), generator=torch.Generator().manual_seed(5)).tolist()
    pages = 32 // cfg.page_size
    with torch.inference_mode():
        kv = KVCache.allocate(cfg, pages, torch.float32, "cpu")
        model(ForwardBatch.build([SeqStep(ids, 0, list(range(pages)))], cfg.page_size, "cpu"), kv)
    for hook in hooks:
        hook.remove()
    assert len(inputs) == cfg.num_layers

    def exceeds(gate_up: torch.Tensor) -> tuple[bool, bool]:
        gate, up = gate_up.chunk(2, dim=-1)
        return bool((gate > SWIGLU_LIMIT).any()), bool((up.abs() > SWIGLU_LIMIT).any())

    with torch.inference_mode():
        for name, x in inputs.items():
            module = model.get_submodule(name)
            if isinstance(module, DenseMLP):
                assert exceeds(x @ module.gate_up_proj.weight.T) == (True, True), name
                continue
            shared = module.shared_experts.gate_up_proj.weight
            assert exceeds(x @ shared.T) == (True, True), f"{name} shared expert"
            # Routed experts: only what the router actually selects counts.
            scores = torch.sigmoid(x @ module.gate.weight.T)
            chosen = torch.topk(scores + module.e_score_correction_bias, cfg.num_experts_per_tok)
            routed = torch.stack(
                [
                    x[t] @ module.experts.w13[e].T
                    for t in range(x.shape[0])
                    for e in chosen.indices[t].tolist()
                ]
            )
            assert exceeds(routed) == (True, True), f"{name} routed experts"


# ---------------------------------------------------------------------- default model path


def test_default_model_path_writes_once_and_then_reuses(tmp_path: Path) -> None:
    first = default_model_path(SMALL_SPEC, root=tmp_path)
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    assert first.parent == tmp_path
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    second = default_model_path(SMALL_SPEC, root=tmp_path)
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in second.iterdir()} == stamps
    # A different spec is a different directory.
    other = default_model_path(dataclasses.replace(SMALL_SPEC, seed=8), root=tmp_path)
    assert other != first and other.parent == tmp_path


def _race_for_default(root: Path, barrier, results) -> None:
    torch.set_num_threads(1)  # forked children must not reuse the parent's thread pool
    barrier.wait(timeout=30)
    results.put(str(default_model_path(SMALL_SPEC, root=root)))


def test_concurrent_first_calls_from_two_processes_share_one_directory(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    workers = [
        ctx.Process(target=_race_for_default, args=(tmp_path, barrier, results)) for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert [w.exitcode for w in workers] == [0, 0]
    paths = []
    for _ in workers:
        try:
            paths.append(results.get(timeout=5))
        except queue.Empty:
            pytest.fail("a worker finished without reporting its path")
    assert paths[0] == paths[1]
    entries = sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock")
    assert entries == [Path(paths[0]).name]  # one model directory, no leftover staging
    assert load_model_config(Path(paths[0])).text.num_layers == SMALL_SPEC.num_layers
    assert Path(paths[0]) == default_model_path(SMALL_SPEC, root=tmp_path)


def test_real_vision_spec_writes_m31s_tower_sizes() -> None:
    spec = TinySpec(vision="real")
    model = parse_model_config(spec.config())
    cfg = vision_config(model)
    assert cfg is not None
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads) == (
        1280,
        5120,
        32,
        16,
    )
    assert cfg.projector_hidden_size == 6144 and cfg.text_hidden_size == spec.hidden_size
    tiny = vision_config(parse_model_config(TinySpec().config()))
    assert tiny is not None and tiny.num_layers == 2


def test_shards_hold_contiguous_layers_in_order(tmp_path: Path) -> None:
    # Written one shard at a time, in inventory order: a layer never spans back to an earlier
    # file, so the writer holds one shard in memory, not the model.
    spec = dataclasses.replace(SMALL_SPEC, num_layers=4, quant="modelopt-mixed", shards=4)
    path = make_tiny(tmp_path / "s", spec)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 4 and files[-1].endswith("-of-00004.safetensors")
    layers_of = {f: set() for f in files}
    for name, file in index["weight_map"].items():
        if ".layers." in name and name.startswith("language_model."):
            layers_of[file].add(int(name.split(".layers.")[1].split(".")[0]))
    spans = [(min(ls), max(ls)) for ls in layers_of.values() if ls]
    assert spans == sorted(spans)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    stored = sum(t.numel() * t.element_size() for f in files for t in load_file(path / f).values())
    assert index["metadata"]["total_size"] == stored
