# m3serve on NVIDIA GPUs: `m3serve serve` behind port 30000, models from the Hugging Face cache.
#
#   docker build -t m3serve .
#   docker run --gpus all --shm-size 32g -p 30000:30000 \
#     -v ~/.cache/huggingface:/home/m3serve/.cache/huggingface m3serve \
#     --model-path MiniMaxAI/MiniMax-M3.1-Flash --host 0.0.0.0 --port 30000
#
# m3serve never downloads weights: fetch them into the mounted cache first (`hf download ...`).
# deploy/compose.yaml is the 4-GPU example; README "Deploy on a 4-GPU node" says what runs today.

# The torch wheels bring their own CUDA libraries; the image's CUDA runtime must be no older
# than the wheel's (cu128 -> 12.8) and the host driver must support it.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# Inside pyproject.toml's range (>=2.11,<2.15); the CUDA wheel index of the same CUDA as above.
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

# gcc and the Python headers: Triton compiles its small kernel-launcher stubs with the system C
# compiler the first time each kernel runs. Distro packages float with the image's security
# updates (see .hadolint.yaml).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/m3serve \
    PATH=/opt/m3serve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the CUDA index, so that resolving m3serve's own requirements keeps it.
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md /src/
COPY m3serve /src/m3serve
# The `gpu` extra adds Triton (the hopper backend's kernels).
RUN pip install --no-cache-dir "/src[gpu]" && rm -rf /src

# Not root. The home holds the Hugging Face cache (a volume) and m3serve's Triton kernel cache.
RUN groupadd --gid 10001 m3serve \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin m3serve
# Numeric, so that the host (and Kubernetes' runAsNonRoot) can tell it is not root.
USER 10001:10001
WORKDIR /home/m3serve
ENV HF_HOME=/home/m3serve/.cache/huggingface
RUN mkdir -p "$HF_HOME"
VOLUME ["/home/m3serve/.cache/huggingface"]

EXPOSE 30000
# /health answers 200 once the engine is ready (after loading and warm-up: minutes for the real
# model, hence the long start period) and 503 when it is draining or dead.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20m --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=4)"]

ENTRYPOINT ["m3serve", "serve"]
# Replaced by any arguments given to `docker run` / compose `command:`; keep --host 0.0.0.0.
CMD ["--host", "0.0.0.0", "--port", "30000"]
