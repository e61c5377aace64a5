"""Model classes by Hugging Face architecture name."""

from engine.models.decoder import DecoderModel

__all__ = ["DecoderModel"]
