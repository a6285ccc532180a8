"""Engines of the light API: the remote inference engine and a local generation server."""
