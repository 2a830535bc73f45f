"""Model definitions: the HF-named config and one decoder for all supported families."""

from .config import ModelConfig
from .decoder import Decoder

__all__ = ["Decoder", "ModelConfig"]
