"""Quantized weights: the stored form shared by every format (``formats``), the formats' readers
(GGUF blocks, online int8/int4), and which layers of a checkpoint get which form (``plan``)."""
