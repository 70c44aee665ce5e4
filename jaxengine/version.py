"""The package version, kept in one place (read by pyproject too)."""

__version__ = "0.1.0.dev0"
