"""Shared layers: every model family is assembled from these."""
