"""The vision side of MiniMax-M3.1: what turns an image or video into the rows the language model
reads. In the tokenizer workers: preprocessing (`processor`, `video`: decode, resize,
normalize, merge-window-major patches [patches, 1176]) and the prompt's placeholder expansion
(`prompt`). In the engine process: the ViT tower, the patch-merge projector and their config and
checkpoint inventory — pixels in, one row per LLM placeholder token out
(`encoder.VisionEncoder`)."""
