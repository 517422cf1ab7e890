"""Tiny random checkpoints in the real MiniMax-M3.1 layout (`m3serve make-tiny`) and the built-in
default model; also the offline byte-level tokenizer and MiniMax-format chat template they ship."""
