"""Inference: text generation with a KV cache, and evaluation."""
