"""Kiln codegen."""
