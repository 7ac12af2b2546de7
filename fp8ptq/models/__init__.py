"""Model intake: HF directories (safetensors), GGUF files and built-in aliases, opened lazily; the
architecture adapters (models/arch/) that say where things are in each family."""

from fp8ptq.models.loader import (  # noqa: F401
    ALIASES,
    ModelSource,
    convert_gguf,
    resolve_model,
)
