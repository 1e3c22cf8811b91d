"""The kvdock server: model registry, request handlers, HTTP API, metrics and the launcher."""
