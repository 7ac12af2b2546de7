"""fp8ptq: offline post-training quantization to compressed-tensors checkpoints for vLLM and SGLang."""

__version__ = "0.1.0"
