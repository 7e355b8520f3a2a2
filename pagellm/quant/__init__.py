"""Quantized weights: the stored form shared by every format (``formats``: integer and FP8 E4M3
codes), the formats' readers (GGUF blocks, AWQ / GPTQ / compressed-tensors checkpoints, online
int8/int4/fp8), and which layers of a checkpoint get which form (``plan``)."""
