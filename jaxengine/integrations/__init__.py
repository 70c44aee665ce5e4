"""Adapters that plug jaxengine into other frameworks.

Each submodule imports the framework it adapts to (`integrations.tunix`: Tunix's
rollout engine interface); this package itself imports none of them, and
``import jaxengine`` never imports this package.
"""
