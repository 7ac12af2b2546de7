"""Model intake: HF directories (safetensors), GGUF files and built-in aliases, opened lazily; the
architecture adapters (models/arch/) that say where things are in each family."""

from fp8ptq.models.gguf_files import ALIASES, convert_gguf  # noqa: F401
from fp8ptq.models.loader import ModelSource, resolve_model  # noqa: F401
