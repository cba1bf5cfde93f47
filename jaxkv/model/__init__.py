"""Llama-family decoders in Flax NNX and their Hugging Face checkpoint loading."""

from jaxkv.model.config import ModelConfig, RopeScaling, UnsupportedModelError

__all__ = ["ModelConfig", "RopeScaling", "UnsupportedModelError"]
