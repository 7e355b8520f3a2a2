"""Decoder models and the registry keyed by the Hugging Face architecture string."""
