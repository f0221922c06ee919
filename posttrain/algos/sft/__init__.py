"""Supervised fine-tuning on chat data: `data` (TRL's record formats, chat-template tokens, the assistant mask by
position), `packing` (best-fit decreasing rows, the batch layout) and `step` (the loss on `learn.step`)."""
