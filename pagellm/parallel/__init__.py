"""Tensor and pipeline parallelism: rank layout, collectives, worker ranks, the executor."""
