"""Turning logits into next tokens."""
