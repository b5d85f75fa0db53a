"""Kiln frontends/compile."""
