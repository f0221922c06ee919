"""Supervised fine-tuning on chat data: records and masks (`data`), packed batches (`packing`), the update (`step`)."""
