"""Child process of tests/helpers/hf_vision.py: runs transformers' MiniMax-M3.1 processors on
the files a job names and saves what they return.

job.json: {"kind": "images", "files": [...], "kwargs": {...}, "out": path.npz}
          -> pixels_<i>, grid_<i> for each file (processed one at a time)
          {"kind": "prompt", "tokenizer_dir": dir, "text": str, "files": [...], "out": ...}
          -> input_ids of the processor's expansion of `text` with those images
          {"kind": "video", "files": [path.npy (T, H, W, 3 uint8)], "kwargs": {...}, "out": ...}
          -> pixels_<i>, grids_<i> of the video processor on each file's (sampled) frames
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np

# torchvision's fake-op registrations need its C ops, which its CUDA wheel cannot load next to
# a CPU torch; the processors never call those ops.
sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")

from PIL import Image, ImageOps  # noqa: E402
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import (  # noqa: E402
    MiniMaxM3VLImageProcessor,
)


def _load(path: str) -> Image.Image:
    # As transformers' load_image, less its RGB conversion (the processor's own runs later).
    image = Image.open(path)
    image.load()
    return ImageOps.exif_transpose(image)


def images(job: dict) -> dict[str, np.ndarray]:
    processor = MiniMaxM3VLImageProcessor(**job.get("kwargs", {}))
    out = {}
    for i, path in enumerate(job["files"]):
        result = processor(images=[_load(path)], return_tensors="pt")
        out[f"pixels_{i}"] = result["pixel_values"].numpy()
        out[f"grid_{i}"] = result["image_grid_thw"].numpy()
    return out


def prompt(job: dict) -> dict[str, np.ndarray]:
    from transformers import PreTrainedTokenizerFast
    from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
    from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import (
        MiniMaxM3VLVideoProcessor,
    )

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=job["tokenizer_file"])
    processor = MiniMaxM3VLProcessor(
        image_processor=MiniMaxM3VLImageProcessor(**job.get("kwargs", {})),
        tokenizer=tokenizer,
        video_processor=MiniMaxM3VLVideoProcessor(),
    )
    pictures = [_load(path) for path in job["files"]]
    result = processor(text=[job["text"]], images=pictures or None, return_tensors="np")
    return {"input_ids": np.asarray(result["input_ids"][0])}


def video(job: dict) -> dict[str, np.ndarray]:
    import torch
    from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import (
        MiniMaxM3VLVideoProcessor,
    )

    processor = MiniMaxM3VLVideoProcessor(**job.get("kwargs", {}))
    out = {}
    for i, path in enumerate(job["files"]):
        frames = torch.from_numpy(np.load(path)).permute(0, 3, 1, 2).contiguous()
        result = processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
        out[f"pixels_{i}"] = result["pixel_values_videos"].numpy()
        out[f"grids_{i}"] = result["video_grid_thw"].numpy()
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    out = {"images": images, "prompt": prompt, "video": video}[job["kind"]](job)
    np.savez(job["out"], **out)


if __name__ == "__main__":
    main()
