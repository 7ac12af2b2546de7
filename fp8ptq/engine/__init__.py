"""Real serving engines, run out of process: vLLM in its own venv (`make vllm`), speaking JSON.
Used by `eval` (verify a checkpoint against the simulation) and `spec` (engine-checked configs)."""
