"""Kiln passes."""
