"""Backbones: model sources, pooling, prompts, export in sentence-transformers format."""
