"""torch.compile frontend: ``torch.compile(f, backend="kiln")`` and ``kiln.compile(f)``."""
