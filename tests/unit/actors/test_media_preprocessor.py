"""MediaPreprocessor hands a video's requested fps to the frame sampler, and the processor's
own rate when the request gives none."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from m3serve.actors import media as media_module
from m3serve.actors.media import MediaPreprocessor
from m3serve.model.vision.video import ProcessedVideo
from m3serve.runtime.messages import MediaBlob


@pytest.mark.parametrize("fps", [None, 2.0])
def test_the_blob_fps_reaches_the_video_processor(
    monkeypatch: pytest.MonkeyPatch, fps: float | None
) -> None:
    calls: list[dict[str, Any]] = []

    def fake(data: bytes, config: Any, max_pixels: int, cap: int | None, rate: Any) -> Any:
        calls.append({"data": data, "fps": rate, "config": config})
        return ProcessedVideo(np.zeros((4, 1176), np.float32), [(1, 2, 2)], 1, [0.0])

    monkeypatch.setattr(media_module, "process_video_bytes", fake)
    preprocessor = MediaPreprocessor(None, 4_000_000)
    prepared = preprocessor.prepare(MediaBlob("video", b"mp4", None, fps))
    assert calls == [{"data": b"mp4", "fps": fps, "config": preprocessor.video}]
    assert prepared.kind == "video" and prepared.tokens.counts == [1]
