"""Command-line tools: ``kiln ls``, ``kiln explain``, ``kiln precompile``, ``kiln cluster``..."""
