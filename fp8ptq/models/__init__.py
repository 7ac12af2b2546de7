"""Model intake: HF directories (safetensors), GGUF files and built-in aliases, opened lazily."""

from fp8ptq.models.loader import (  # noqa: F401
    ALIASES,
    SUPPORTED_MODEL_TYPES,
    ModelSource,
    convert_gguf,
    resolve_model,
)
