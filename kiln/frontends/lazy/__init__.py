"""Kiln frontends/lazy."""
