"""msgpack encoding of the message unions in `messages.py`, with numpy arrays as zero-copy frames.

A message becomes a multipart list of frames: frame 0 is the msgpack body, and every array of at
least `ZERO_COPY_THRESHOLD` bytes follows as a frame of its own, referenced from the body by a
msgpack extension holding (frame index, dtype, shape). Smaller arrays travel inside the body in an
extension holding (dtype, shape, bytes): for them a frame of their own costs more than the copy.

Ownership: `encode` hands out views of the caller's arrays (no copy), so an array must not be
modified after its message is sent. `decode` returns out-of-band arrays as `np.frombuffer` views
over the received frames (no copy; read-only when the frame is, e.g. `bytes`); inline arrays are
small private copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

T = TypeVar("T")

ZERO_COPY_THRESHOLD = 1024

# msgpack extension type codes; 0..127 are free for applications.
EXT_ARRAY_FRAME = 1  # payload: msgpack [frame index, dtype str, shape]
EXT_ARRAY_INLINE = 2  # payload: msgpack [dtype str, shape, raw bytes]

Frame = bytes | bytearray | memoryview
Shape = tuple[int, ...]


def _check_dtype(dtype: np.dtype[Any]) -> None:
    # dtype.str names plain dtypes exactly; structured and object dtypes do not survive it.
    if dtype.hasobject or dtype.fields is not None:
        raise TypeError(f"cannot send arrays of dtype {dtype}: only plain numeric dtypes")


def _raw_bytes(arr: np.ndarray) -> memoryview:
    """The array's bytes in C order as a flat byte view; copies only when not C-contiguous."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    return memoryview(flat.view(np.uint8))


class Codec(Generic[T]):
    """Encoder and decoder for one channel's message union (e.g. `ToScheduler`).

    An instance keeps its msgspec encoder/decoder (and their buffers) between calls. It is not
    thread-safe: `encode`/`decode` keep per-call state on the instance, so use one per thread.
    """

    def __init__(self, msg_type: Any, zero_copy_threshold: int = ZERO_COPY_THRESHOLD) -> None:
        # `Any`: channel types are unions (`A | B`), which `type[T]` cannot express.
        self.msg_type = msg_type
        self.zero_copy_threshold = zero_copy_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(
            msg_type, dec_hook=self._dec_hook, ext_hook=self._ext_hook
        )
        self._header_encoder = msgspec.msgpack.Encoder()
        self._frame_header = msgspec.msgpack.Decoder(tuple[int, str, Shape])
        self._inline_header = msgspec.msgpack.Decoder(tuple[str, Shape, bytearray])
        self._out: list[Frame] = []
        self._in: Sequence[Frame] = ()

    def encode(self, msg: T) -> list[Frame]:
        """Frames for `msg`: the msgpack body first, then one frame per large array."""
        frames: list[Frame] = [b""]
        self._out = frames
        try:
            frames[0] = self._encoder.encode(msg)
        finally:
            self._out = []
        return frames

    def decode(self, frames: Sequence[Frame]) -> T:
        """The message in `frames` (any buffer objects, e.g. `zmq.Frame.buffer`)."""
        self._in = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._in = ()

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._array_ext(obj)
        if isinstance(obj, np.generic):
            return obj.item()  # a numpy scalar where the schema says int/float/bool
        raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")

    def _array_ext(self, arr: np.ndarray) -> msgspec.msgpack.Ext:
        _check_dtype(arr.dtype)
        if arr.nbytes >= self.zero_copy_threshold:
            self._out.append(_raw_bytes(arr))
            header = (len(self._out) - 1, arr.dtype.str, arr.shape)
            return msgspec.msgpack.Ext(EXT_ARRAY_FRAME, self._header_encoder.encode(header))
        payload = (arr.dtype.str, arr.shape, _raw_bytes(arr))
        return msgspec.msgpack.Ext(EXT_ARRAY_INLINE, self._header_encoder.encode(payload))

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_ARRAY_FRAME:
            index, dtype, shape = self._frame_header.decode(data)
            if not 0 < index < len(self._in):
                raise ValueError(f"array frame {index} missing: {len(self._in)} frames arrived")
            return np.frombuffer(self._in[index], dtype=np.dtype(dtype)).reshape(shape)
        if code == EXT_ARRAY_INLINE:
            dtype, shape, raw = self._inline_header.decode(data)
            # `raw` is a private bytearray, so the array is writable and outlives the body frame.
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
        raise ValueError(f"unknown msgpack extension type {code}")

    def _dec_hook(self, type_: type, obj: Any) -> Any:
        if type_ is np.ndarray and isinstance(obj, np.ndarray):
            return obj
        raise TypeError(f"expected {type_.__name__}, got {type(obj).__name__}")
