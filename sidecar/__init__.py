"""retry-sidecar: an HTTP reverse proxy that does retries right."""

__version__ = "0.1.0"


def build() -> str:
    """Which build runs: "compiled" when the hot path was compiled with mypyc (see setup.py),
    else "pure"."""
    from sidecar import core

    return "compiled" if not core.__file__ or not core.__file__.endswith(".py") else "pure"
