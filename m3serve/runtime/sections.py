"""The config sections: one frozen dataclass per area (model, cache, scheduling, API, ...),
each checking its own settings when built. `config.ServerArgs` puts them together.

Flag names follow SGLang's where SGLang has the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from m3serve.runtime.options import ConfigInvalid, option, raise_problems


@dataclass(frozen=True)
class ModelArgs:
    model_path: str | None = option(
        None, "checkpoint directory; default: the built-in tiny M3.1 checkpoint"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "compute dtype; auto = float32 on CPU, the checkpoint's dtype on GPU"
    )
    revision: str | None = option(
        None, "Hub revision: resolves a Hub id from the local Hugging Face cache (no download)"
    )
    trust_remote_code: bool = option(False, "accepted for SGLang compatibility; no code is run")


@dataclass(frozen=True)
class BackendArgs:
    backend: Literal["auto", "reference", "hopper", "blackwell", "rocm"] = option(
        "auto", "kernel backend; auto picks by device"
    )
    device: str = option("auto", "torch device: auto, cpu, cuda, cuda:N")

    def __post_init__(self) -> None:
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda")):
            raise ConfigInvalid(f"--device {self.device!r}: expected auto, cpu, cuda or cuda:N")


@dataclass(frozen=True)
class CacheArgs:
    max_total_tokens: int | None = option(
        None, "KV pool size in tokens; default: from --mem-fraction-static (GPU) or 65536 (CPU)"
    )
    mem_fraction_static: float = option(0.85, "fraction of GPU memory for weights + KV pool")
    disable_radix_cache: bool = option(False, "turn off prefix caching")
    kv_cache_dtype: Literal["auto", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2"] = option(
        "auto", "KV cache dtype; auto = the compute dtype"
    )
    page_size: int | None = option(
        None, "KV page size in tokens; must equal the model's sparse block size (128 for M3.1)"
    )

    def __post_init__(self) -> None:
        problems = []
        if self.max_total_tokens is not None and self.max_total_tokens <= 0:
            problems.append("--max-total-tokens must be positive")
        if not 0.0 < self.mem_fraction_static < 1.0:
            problems.append("--mem-fraction-static must be in (0, 1)")
        raise_problems(problems)


@dataclass(frozen=True)
class SchedArgs:
    max_running_requests: int = option(256, "most requests decoding at once")
    chunked_prefill_size: int = option(8192, "longest prefill chunk in tokens; -1 disables")
    max_prefill_tokens: int = option(16384, "token budget of one prefill step")
    max_queued_requests: int = option(4096, "waiting-queue length beyond which requests get 503")
    disable_overlap_schedule: bool = option(False, "run steps strictly one after another")
    launch_ahead: Literal["auto", "on", "off"] = option(
        "auto",
        "under overlap, queue a step's kernels behind the step in flight before that step's "
        "tokens reach the host, where nothing in the step needs them there (no grammar, "
        "logprobs, images, page loads, speculation or --tp): steps follow each other on the "
        "device without waiting for a launch. auto: where launches are asynchronous (a GPU; a "
        "CPU computes a step in its launch) (README, Notes: launching ahead)",
    )
    schedule_policy: Literal["fcfs", "lpm"] = option(
        "fcfs",
        "waiting-queue order: first come first served, or longest cached prefix first (lpm; "
        "arrival order past 128 waiting requests)",
    )
    init_new_token_ratio: float = option(
        0.7, "share of max_new_tokens reserved at admission (decays under no pressure)"
    )
    min_new_token_ratio: float = option(0.1, "floor of the decaying reservation ratio")
    new_token_ratio_decay: float = option(0.001, "per-step decay of the reservation ratio")
    mixed_step_stretch: float = option(
        2.5,
        "a step that decodes carries only as many prompt tokens as keep it within this many "
        "pure decode steps (measured at start on a GPU), which bounds inter-token latency "
        "while prompts are prefilled; 0 gives every step the whole --chunked-prefill-size",
    )
    mixed_step_min_tokens: int = option(
        256,
        "the served mixed-step budget never shrinks below this many prompt tokens (0: one "
        "quantum); where a step's fixed cost fills the stretch, smaller chunks are no faster "
        "and only prefill slower",
    )
    mixed_step_demand_margin: float = option(
        0.0,
        "cap each mixed step's prompt budget at this many times what its batch consumes: its "
        "decode rows x the prompt tokens finished requests needed per output token (0: off); "
        "spreads prefill over most steps where a mixed step's cost is mostly fixed",
    )

    def __post_init__(self) -> None:
        problems = []
        if self.mixed_step_stretch != 0 and self.mixed_step_stretch <= 1:
            problems.append("--mixed-step-stretch must be 0 (off) or above 1")
        if self.mixed_step_min_tokens < 0:
            problems.append("--mixed-step-min-tokens must be >= 0")
        if self.mixed_step_demand_margin < 0:
            problems.append("--mixed-step-demand-margin must be >= 0")
        if self.max_running_requests < 1:
            problems.append("--max-running-requests must be >= 1")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            problems.append("--chunked-prefill-size must be positive or -1")
        if self.max_prefill_tokens < 1:
            problems.append("--max-prefill-tokens must be >= 1")
        if self.max_queued_requests < 1:
            problems.append("--max-queued-requests must be >= 1")
        if not 0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0:
            problems.append("need 0 <= --min-new-token-ratio <= --init-new-token-ratio <= 1")
        raise_problems(problems)


@dataclass(frozen=True)
class RuntimeArgs:
    single_process: bool = option(False, "run every actor in this process (tests, small uses)")
    tokenizer_worker_num: int = option(1, "tokenizer worker processes")
    skip_tokenizer_init: bool = option(False, "token ids in and out only; no tokenizer files")
    context_length: int | None = option(None, "max prompt + output tokens; default: the model's")
    startup_timeout: float = option(300.0, "seconds to wait for every actor to be ready")
    graceful_shutdown_timeout: float = option(
        30.0,
        "on SIGTERM / Ctrl-C: seconds running requests get to finish (new ones get 503) before "
        "the rest are ended with an error",
    )
    enable_step_trace: bool = option(
        False,
        "log one line per engine step: kind, batch, tokens, host and run ms, kernels compiled",
    )
    max_prompt_chars: int | None = option(
        None,
        "longest prompt text (characters) a tokenizer worker encodes; a longer one gets 400 "
        "before it is tokenized; default: 16 x the context length",
    )

    def __post_init__(self) -> None:
        problems = []
        if self.tokenizer_worker_num < 1:
            problems.append("--tokenizer-worker-num must be >= 1")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            problems.append("--max-prompt-chars must be >= 1")
        if self.context_length is not None and self.context_length < 2:
            problems.append("--context-length must be >= 2")
        if self.graceful_shutdown_timeout < 0:
            problems.append("--graceful-shutdown-timeout must be >= 0")
        raise_problems(problems)


@dataclass(frozen=True)
class ApiArgs:
    host: str = option("127.0.0.1", "address the HTTP server binds")
    port: int = option(30000, "HTTP port")
    api_key: str | None = option(
        None, "require 'Authorization: Bearer <key>' on every endpoint except /health"
    )
    served_model_name: str | None = option(
        None, "model id in /v1/models and responses; default: the model path"
    )
    reasoning_parser: Literal["minimax-m3"] | None = option(
        None, "put the <mm:think> trace in reasoning_content"
    )
    tool_call_parser: Literal["minimax-m3"] | None = option(
        None, "turn MiniMax tool-call XML into OpenAI tool_calls"
    )
    max_request_bytes: int = option(64 << 20, "request bodies larger than this get HTTP 413")
    request_body_timeout: float = option(
        30.0, "seconds to wait for each next piece of a request body; a stalled body gets 408"
    )
    max_fanout: int = option(
        128, "most engine requests one HTTP request may make (n x prompts); more get 400"
    )
    allowed_hosts: list[str] | None = option(
        None,
        "Host header values accepted (name or IP, *.domain for subdomains, * for any); others "
        "get 400. Default: any, as in SGLang and vLLM; set e.g. 'localhost 127.0.0.1' on an "
        "unauthenticated local server to refuse DNS-rebinding requests",
    )
    api_key_file: str | None = option(
        None, "read --api-key from this file (keeps it out of ps); else M3SERVE_API_KEY is read"
    )
    log_requests: bool = option(
        False, "log prompts and outputs (off by default: they are user data)"
    )

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.port < 65536:
            problems.append("--port must be in 1..65535")
        if self.max_request_bytes < 1024:
            problems.append("--max-request-bytes must be >= 1024")
        if self.api_key is not None and not self.api_key:
            problems.append("--api-key must not be empty")
        if self.api_key is not None and self.api_key_file is not None:
            problems.append("give one of --api-key and --api-key-file")
        if self.request_body_timeout <= 0:
            problems.append("--request-body-timeout must be positive")
        if self.max_fanout < 1:
            problems.append("--max-fanout must be >= 1")
        raise_problems(problems)


# Sections for features that are planned but not built: their flags parse (so the launch
# commands of SGLang's MiniMax-M3.1 cookbook work verbatim), and any setting that would need the
# missing feature stops the start with one message listing all of them.


@dataclass(frozen=True)
class ParallelArgs:
    tp_size: int = option(
        1, "tensor-parallel size: ranks (GPUs) one model is split over", flag="--tp"
    )
    ep_size: int = option(
        1,
        "expert-parallel size: the routed experts are split into this many groups of "
        "--tp / --ep ranks, each group splitting its experts' width (1: every rank holds a slice "
        "of every expert; --tp: whole experts)",
        flag="--ep",
    )
    attn_dp_size: int = option(1, "attention data-parallel size")
    enable_dp_lm_head: bool = option(False, "data-parallel LM head (with attention DP)")

    def __post_init__(self) -> None:
        # How --ep fits --tp and the model (heads, experts) and the devices is checked at start
        # (`engine/checks.py`), so that SGLang launch commands (--tp 4 --ep 8) still parse.
        if self.tp_size < 1 or self.ep_size < 1 or self.attn_dp_size < 1:
            raise ConfigInvalid("--tp, --ep and --attn-dp-size must be >= 1")


@dataclass(frozen=True)
class SpecArgs:
    speculative_algorithm: Literal["DSPARK", "DFLASH", "EAGLE", "NGRAM"] | None = option(
        None, "speculative decoding algorithm"
    )
    speculative_draft_model_path: str | None = option(None, "draft checkpoint directory")
    speculative_num_steps: int | None = option(None, "draft steps per round")
    speculative_eagle_topk: int | None = option(None, "draft branching factor")
    speculative_num_draft_tokens: int | None = option(None, "tokens verified per round")
    speculative_dspark_block_size: int | None = option(None, "DSpark block size")
    speculative_use_block_verification: bool = option(False, "block verification of samples")
    speculative_draft_kv_cache_dtype: str | None = option(None, "draft KV cache dtype")
    speculative_accept_length_override: float = option(
        0.0,
        "benchmarking only, breaks exactness: every verify step commits L tokens (L-1 drafts, "
        "then the target's token) whatever the draft proposed; a fractional L mixes the two "
        "nearest lengths to average L; 0 = off",
    )


@dataclass(frozen=True)
class HiCacheArgs:
    enable_hierarchical_cache: bool = option(
        False, "keep KV pages evicted from the device in a host-memory pool (HiCache)"
    )
    hicache_ratio: float = option(
        2.0, "host pool size as a multiple of the device pool (at least 2; lowered to fit RAM)"
    )
    hicache_size: int = option(0, "host pool GB per rank (overrides --hicache-ratio)")
    hicache_write_policy: Literal["write_through", "write_back", "write_through_selective"] = (
        option(
            "write_through",
            "when device pages are copied to host: as they are cached (write_through), when "
            "evicted from the device (write_back), or once a prefix was hit twice (selective)",
        )
    )
    hicache_storage_backend: str | None = option(
        None, "L3 storage backend under the host pool: file (one file per page in a directory)"
    )
    hicache_storage_dir: str | None = option(
        None,
        "directory of the file storage backend; replicas given the same one share its pages; "
        "default: <m3serve cache dir>/hicache",
    )
    hicache_host_memory_fraction: float = option(
        0.8, "share of the host's available memory the host pool may take"
    )

    def __post_init__(self) -> None:
        problems = []
        if self.hicache_ratio < 2:
            problems.append(
                f"--hicache-ratio {self.hicache_ratio}: must be >= 2 (the host pool holds what "
                "the device pool evicts, so it must be larger than it)"
            )
        if self.hicache_size < 0:
            problems.append("--hicache-size must be >= 0")
        if not 0.0 < self.hicache_host_memory_fraction <= 1.0:
            problems.append("--hicache-host-memory-fraction must be in (0, 1]")
        raise_problems(problems + self._storage_problems())

    def _storage_problems(self) -> list[str]:
        backend = self.hicache_storage_backend
        if backend is None:
            if self.hicache_storage_dir is not None:
                return ["--hicache-storage-dir needs --hicache-storage-backend file"]
            return []
        if backend not in STORAGE_BACKENDS:
            built = ", ".join(STORAGE_BACKENDS)
            return [f"--hicache-storage-backend {backend}: this build has {built}"]
        if not self.enable_hierarchical_cache:
            return ["--hicache-storage-backend needs --enable-hierarchical-cache"]
        return []


# The L3 storage backends this build has (actors/hicache/storage.py maps them to classes).
STORAGE_BACKENDS = ("file",)


# What this build can run the routed experts with (which of them a backend takes: backends/).
MOE_RUNNERS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class KernelArgs:
    disable_cuda_graph: bool = option(False, "run decode eagerly")
    skip_warmup: bool = option(
        False,
        "skip the warm-up pass that compiles every Triton kernel variant before the server is "
        "ready (requests of new shapes then wait for compiles)",
    )
    full_warmup: bool = option(
        False,
        "run the whole warm-up pass even where the record of an earlier start with the same "
        "code, device, model and settings names the few plans that load kernels "
        "(core/warmup_record.py)",
    )
    cuda_graph_max_bs_decode: int | None = option(
        None, "largest decode batch replayed from a CUDA graph (hopper backend; default 128)"
    )
    cuda_graph_max_bs_prefill: int | None = option(
        None,
        "largest prefill or mixed step, in tokens, replayed from piecewise CUDA graphs (hopper "
        "backend; default: the step token budget, at most 4096); larger steps run eagerly",
    )
    cuda_graph_backend_prefill: Literal["breakable", "disabled"] | None = option(
        None,
        "CUDA graphs for prefill and mixed steps: breakable (captured pieces between eager "
        "attention calls; the default where decode graphs run) or disabled",
    )
    moe_runner_backend: str = option(
        "auto",
        "what runs the routed experts: auto, triton (W4A16 NVFP4 fused MoE; hopper) or torch "
        "(dense experts, NVFP4 dequantized at load)",
    )
    mxfp8_bf16_copy: bool = option(
        True,
        "also hold each MXFP8 projection as bf16 (2 more bytes a weight: ~5 GB a GPU for "
        "M3.1 at --tp 4) for steps of 65 or more rows (prefills, mixed steps, big decode "
        "batches), which then multiply it in cuBLAS with no per-call dequantization; decode "
        "batches up to 64 keep reading the MXFP8 codes (hopper backend; "
        "--no-mxfp8-bf16-copy saves the memory)",
    )
    monokernel_backend: str | None = option(None, "persistent decode kernel backend")
    disable_attn_tp_gather: bool = option(False, "attention TP gather off (MonoKernel)")
    prefill_decode_interval: int | None = option(None, "decode steps between prefill batches")


@dataclass(frozen=True)
class MediaArgs:
    """Image and video input: what a request may bring and where the server may fetch it from."""

    max_media_bytes: int = option(
        32 << 20, "largest encoded image or video (bytes) one content part may carry or fetch"
    )
    max_image_pixels: int = option(
        100_000_000,
        "most pixels an image (or a video frame) may declare; larger ones get 400 from their "
        "header, before decoding (decompression bombs)",
    )
    allowed_media_domains: list[str] | None = option(
        None,
        "hosts that media URLs may fetch from even when they resolve to loopback, private or "
        "link-local addresses (refused otherwise)",
    )
    allowed_local_media_path: str | None = option(
        None, "directory file:// media URLs may read (no escaping it); default: file:// refused"
    )
    media_fetch_timeout: float = option(10.0, "seconds one media URL fetch may take in all")

    def __post_init__(self) -> None:
        problems = []
        if self.max_media_bytes < 1:
            problems.append("--max-media-bytes must be >= 1")
        if self.max_image_pixels < 1:
            problems.append("--max-image-pixels must be >= 1")
        if self.media_fetch_timeout <= 0:
            problems.append("--media-fetch-timeout must be positive")
        raise_problems(problems)
