"""Kiln: an open training compiler and lazy accelerator runtime for PyTorch."""

__version__ = "0.1.0"

__all__ = ["__version__"]
