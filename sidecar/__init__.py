"""retry-sidecar: an HTTP reverse proxy that does retries right."""

__version__ = "0.1.0"
