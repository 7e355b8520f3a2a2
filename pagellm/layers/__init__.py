"""Model building blocks shared by the decoder models."""
