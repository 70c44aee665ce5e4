"""Logical axis names -> mesh axes for tensor, pipeline, data and expert parallelism."""
