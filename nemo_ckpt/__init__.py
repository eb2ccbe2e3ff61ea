"""NeMo 2.0-style training on plain PyTorch, with Megatron-Core-compatible distributed checkpoints."""
