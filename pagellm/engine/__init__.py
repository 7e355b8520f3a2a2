"""The engine core in plain Python: importing it must not import torch (a test enforces this)."""
