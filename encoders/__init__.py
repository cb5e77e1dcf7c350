"""Backbones: model sources, pooling, prompts, export in sentence-transformers format."""

from encoders.lazy_imports import defer_optional_imports

defer_optional_imports()  # before anything here imports sentence-transformers (and through it peft, bitsandbytes)
