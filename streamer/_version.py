"""The package version: its one source (pyproject.toml reads it from here into the metadata)."""

__version__ = "0.1.0"
