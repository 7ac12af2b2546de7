"""fp8ptq: offline post-training quantization to compressed-tensors checkpoints for vLLM and SGLang.

`fp8ptq.quantize(model, recipe, output)` quantizes (fp8ptq/library.py); `fp8ptq.Recipe` builds recipes in
Python; the other jobs take one config each, as the CLI's subcommands do (fp8ptq/api.py). Names resolve
on first use: `import fp8ptq` itself imports neither torch nor transformers.
"""

__version__ = "0.1.0"

# public name -> (module, attribute)
_EXPORTS = {
    "quantize": ("fp8ptq.library", "quantize"),
    "QuantizeResult": ("fp8ptq.library", "QuantizeResult"),
    "QuantizeConfig": ("fp8ptq.runs.config", "QuantizeConfig"),
    "Recipe": ("fp8ptq.recipe", "Recipe"),
    "model_free": ("fp8ptq.runs.model_free", "model_free"),
    "ModelFreeConfig": ("fp8ptq.runs.config", "ModelFreeConfig"),
    "convert": ("fp8ptq.api", "convert"),
    "ConvertConfig": ("fp8ptq.api", "ConvertConfig"),
    "inspect": ("fp8ptq.api", "inspect"),
    "InspectConfig": ("fp8ptq.api", "InspectConfig"),
    "evaluate": ("fp8ptq.api", "evaluate_quality"),
    "EvalConfig": ("fp8ptq.api", "EvalConfig"),
    "analyze": ("fp8ptq.api", "analyze"),
    "AnalyzeConfig": ("fp8ptq.api", "AnalyzeConfig"),
    "verify": ("fp8ptq.api", "verify"),
    "VerifyConfig": ("fp8ptq.api", "VerifyConfig"),
}
__all__ = ["__version__", *list(_EXPORTS)]  # noqa: PLE0604 - the keys, all strings


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fp8ptq' has no attribute {name!r}")
    import importlib

    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
