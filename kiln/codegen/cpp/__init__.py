"""Kiln codegen/cpp."""
