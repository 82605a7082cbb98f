"""Llama-3.2-Vision (Mllama): vision encoder, projector and cross-attention Llama decoder."""

from edserve.models.mllama.config import MllamaConfig, MllamaTextConfig, MllamaVisionConfig
from edserve.models.mllama.model import MllamaModel
from edserve.models.mllama.weights import load_mllama

__all__ = ["MllamaConfig", "MllamaModel", "MllamaTextConfig", "MllamaVisionConfig",
           "load_mllama"]
