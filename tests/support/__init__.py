"""What several test files share: tiny stages, published draft layouts, numerics, torchrun and vLLM helpers."""
