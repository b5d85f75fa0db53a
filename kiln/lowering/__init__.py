"""Kiln lowering."""
