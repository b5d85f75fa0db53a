"""Kiln cluster."""
