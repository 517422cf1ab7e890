"""The M3.1 vision side of the network: the ViT tower, the patch-merge projector and their
config and checkpoint inventory. Pixels in ([patches, 1176], merge-window-major), one row per
LLM placeholder token out (`encoder.VisionEncoder`)."""
