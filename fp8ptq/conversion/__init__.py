"""Checkpoint conversion between GGUF and compressed-tensors (exact where the numbers allow), and inspection."""
