"""Test-wide setup: every test run gets its own compile-cache folder (never the user's)."""

import os
import tempfile

os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-test-cache-"))
# The native graph launcher depends only on its source, torch and the compiler (its file name
# says which): one build serves every test run and every process the tests start.
os.environ.setdefault(
    "KILN_LAUNCHER_DIR", os.path.join(tempfile.gettempdir(), f"kiln-test-launcher-{os.getuid()}")
)
