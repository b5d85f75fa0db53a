"""Kiln devices."""
