"""kvdock: a KV-cache server and a Python SDK for it."""

__version__ = "0.1.0"
