"""Video preprocessing: frame sampling within the processor's limits, patches equal to
transformers' video processor on the same frames, PyAV decoding of a real file, timestamps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.hf_vision import run_oracle
from helpers.vision_images import mp4

from m3serve.model.vision.processor import MediaDecodeError
from m3serve.model.vision.processor_config import VideoProcessorConfig
from m3serve.model.vision.video import (
    preprocess_frames,
    process_video_bytes,
    sample_indices,
    timestamp_text,
    with_fps,
)

CONFIG = VideoProcessorConfig()


def frames(count: int, h: int, w: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for _ in range(count)]


def test_sampling_follows_fps_within_the_frame_limits() -> None:
    # 10 s at 30 fps, 1 frame per second: 10 frames, evenly spaced.
    assert sample_indices(300, 30.0, CONFIG) == list(range(0, 300, 30))
    # Short clips still give min_frames (when they have them) ...
    assert len(sample_indices(20, 30.0, CONFIG)) == CONFIG.min_frames
    # ... never more than there are, and long ones at most max_frames.
    assert sample_indices(3, 30.0, CONFIG) == [0, 1, 2]
    assert len(sample_indices(10**6, 30.0, CONFIG)) == CONFIG.max_frames
    with pytest.raises(MediaDecodeError):
        sample_indices(0, 30.0, CONFIG)


def test_patches_equal_hf_video_processor(tmp_path: Path) -> None:
    shapes = [(4, 56, 84), (5, 100, 70), (9, 64, 64), (3, 600, 500)]
    clips = [frames(count, h, w, count) for count, h, w in shapes]
    files = []
    for i, clip in enumerate(clips):
        np.save(tmp_path / f"{i}.npy", np.stack(clip))
        files.append(str(tmp_path / f"{i}.npy"))
    hf = run_oracle({"kind": "video", "files": files}, tmp_path)
    for i, clip in enumerate(clips):
        ours = preprocess_frames(clip, list(range(len(clip))), 1.0, CONFIG)
        assert [list(g) for g in ours.grids] == hf[f"grids_{i}"].tolist()
        assert np.array_equal(ours.pixels, hf[f"pixels_{i}"])
        # One timestamp per temporal patch: the first frame of each pair.
        assert ours.timestamps == [float(2 * t) for t in range(ours.temporal_patches)]


def test_long_videos_split_into_segments_of_four_temporal_patches() -> None:
    video = preprocess_frames(frames(18, 28, 28), list(range(18)), 2.0, CONFIG)
    # 28 x 28 frames are scaled up to the 56 x 56 minimum: 4 x 4 patches, 4 tokens each.
    assert video.grids == [(4, 4, 4), (4, 4, 4), (1, 4, 4)]
    assert video.pixels.shape == (9 * 16, 1176)
    assert video.frame_tokens == 4
    assert timestamp_text(video.timestamps[1]) == "]<]1.0 seconds[>["


def test_an_mp4_decodes_to_sampled_frames() -> None:
    data = mp4(count=24, fps=4, h=64, w=96)  # 6 s
    video = process_video_bytes(data, CONFIG)
    assert video.temporal_patches == 3  # 6 frames at 1 fps, in pairs
    _, gh, gw = video.grids[0]
    assert (gh * 14, gw * 14) == (56, 84)
    assert video.timestamps == [0.0, 2.0, 4.0]


def test_video_frames_over_the_pixel_cap_are_refused() -> None:
    data = mp4(count=4, fps=4, h=64, w=96)
    with pytest.raises(MediaDecodeError, match="--max-image-pixels"):
        process_video_bytes(data, CONFIG, max_pixels=1000)


def test_garbage_is_not_a_video() -> None:
    pytest.importorskip("av")
    with pytest.raises(MediaDecodeError, match="cannot decode the video"):
        process_video_bytes(b"definitely not a video", CONFIG)


def test_max_long_side_caps_each_frame() -> None:
    clip = frames(4, 300, 600)
    free = preprocess_frames(clip, [0, 1, 2, 3], 1.0, CONFIG)
    capped = preprocess_frames(clip, [0, 1, 2, 3], 1.0, CONFIG, max_long_side=280)
    assert max(free.grids[0][1:]) * 14 > 280
    assert max(capped.grids[0][1:]) * 14 <= 280


def test_a_request_fps_changes_the_rate_within_the_frame_limits() -> None:
    # 100 s of video at 30 fps: the processor's 1 fps keeps 100 frames, 2 fps keeps 200.
    assert len(sample_indices(3000, 30.0, with_fps(CONFIG, None))) == 100
    assert len(sample_indices(3000, 30.0, with_fps(CONFIG, 2))) == 200
    # A tiny rate still keeps min_frames, a huge one at most max_frames and the frames there are.
    assert len(sample_indices(3000, 30.0, with_fps(CONFIG, 1e-6))) == CONFIG.min_frames
    assert len(sample_indices(10**6, 30.0, with_fps(CONFIG, 1e9))) == CONFIG.max_frames
    assert sample_indices(50, 30.0, with_fps(CONFIG, 1e9)) == list(range(50))


@pytest.mark.parametrize("fps", [0, -2.0, float("nan"), float("inf")])
def test_a_non_positive_fps_is_a_decode_error(fps: float) -> None:
    with pytest.raises(MediaDecodeError, match="fps"):
        with_fps(CONFIG, fps)
