"""Test-wide setup: every test run gets its own compile-cache folder (never the user's)."""

import os
import tempfile

os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-test-cache-"))
