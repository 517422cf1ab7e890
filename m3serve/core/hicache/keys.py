"""Page keys for the L3 storage tier: a hash chain over the token prefix.

key(page 0) = H(root ‖ tokens of page 0), key(page i) = H(key(page i - 1) ‖ tokens of page i),
with H = sha256 and tokens as little-endian int32. A page's key therefore names its whole prefix,
not just its own tokens: equal prefixes give equal keys, on any host, in any process, and a
change in page i changes the keys of pages i, i + 1, ... only. The root hashes everything else
that decides a page's bytes (the checkpoint, page size, KV dtype, the rank's share of the
heads), so two models, or two layouts of one model, never share a key.

Keys are hex strings: they name files in the file backend and travel in messages as text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

PageKey = str  # 64 hex digits

# Bumped when the chain's definition changes, so old stores are never misread.
KEY_VERSION = b"m3serve-hicache-page-key-v1"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def root_key(model: str, page_size: int, kv_dtype: str, layout: str = "") -> PageKey:
    """The key of the empty prefix. `model` identifies the weights (`checkpoint_identity`);
    `layout` is anything else that changes a page's bytes (e.g. "tp2/rank1", the host layout)."""
    h = hashlib.sha256(KEY_VERSION)
    for part in (model, str(page_size), kv_dtype, layout):
        data = part.encode()
        # Length-prefixed, so ("ab", "c") and ("a", "bc") hash differently.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def next_key(parent: PageKey, page_tokens: Sequence[int] | np.ndarray) -> PageKey:
    """The key of the page holding `page_tokens` right after the prefix whose key is `parent`."""
    h = hashlib.sha256(bytes.fromhex(parent))
    h.update(_int32_bytes(page_tokens))
    return h.hexdigest()


def page_keys(parent: PageKey, tokens: Sequence[int] | np.ndarray, page_size: int) -> list[PageKey]:
    """Keys of every full page of `tokens`, which follow the prefix whose key is `parent` (the
    root for a whole prompt). A trailing partial page has no key: only full pages are stored."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    arr = np.asarray(tokens)
    keys = []
    for start in range(0, arr.size - page_size + 1, page_size):
        parent = next_key(parent, arr[start : start + page_size])
        keys.append(parent)
    return keys


def checkpoint_identity(model_dir: Path) -> str:
    """What tells one checkpoint from another without reading its weights: config.json's bytes
    and the name, size and modification time of every weight file. A copy elsewhere (new mtimes)
    gets a new identity: a cache miss, never a wrong page."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(p for p in model_dir.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        stat = path.stat()
        h.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return h.hexdigest()


def _int32_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got {arr.dtype}")
    if arr.min() < -(2**31) or arr.max() >= 2**31:
        raise ValueError("token ids must fit in int32")
    return arr.astype("<i4").tobytes()
