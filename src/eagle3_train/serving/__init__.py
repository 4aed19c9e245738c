"""Talking to serving engines: the vLLM server launcher and the OpenAI-compatible client (used by generate, extract
and evaluate)."""
