"""Settings and the model: configuration, run-config sections, errors, the target, vLLM support."""
