"""Export: compressed-tensors checkpoints, written atomically, plus manifest."""
