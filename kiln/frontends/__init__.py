"""Kiln frontends."""
