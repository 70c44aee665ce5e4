"""Golden tests of model families against transformers."""
