"""Quality under simulated engine numerics, for any compressed-tensors checkpoint."""
