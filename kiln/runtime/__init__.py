"""Kiln runtime."""
