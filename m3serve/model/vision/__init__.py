"""The vision side of MiniMax-M3.1: what turns an image or video into the rows the language model
reads. Preprocessing (decode, resize, normalize, patchify; video frame sampling) and the
prompt's placeholder expansion run in the tokenizer workers; the vision tower and projector run
in the engine process."""
