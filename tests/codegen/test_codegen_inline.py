"""The prelude's math helpers are inlined into every kernel that calls them.

At -O2 g++ inlines a large ``static inline`` function only where it has one caller: with two
kernels calling ``km::erf`` in one unit it stayed an out-of-line call per element and that loop
did not vectorize (~9x slower).  The helpers are ``always_inline`` (kiln/codegen/cpp/ops.py); a
unit whose every kernel calls each of them twice must keep none of them as a symbol.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest
import torch
from kiln_codegen_testlib import cpp_only

from kiln.codegen.cpp.build import build_many
from kiln.codegen.cpp.ops import PRELUDE

CALLS = [
    "km::exp(x)",
    "km::erf(x)",
    "kiln_erf_cdf(x)",
    "kiln_gelu_bwd(y, x)",
    "kiln_gelu_tanh_bwd(y, x)",
    "kiln_silu_bwd(y, x)",
    "kiln_max(x, y)",
]


def _unit() -> str:
    """Two kernels per helper, one helper each (the shape of the unit that showed the problem)."""
    kernels = []
    for k, call in enumerate(CALLS * 2):
        kernels.append(
            f'extern "C" void kiln_inline_test_{k}(float* out, const float* a, const float* b, '
            "int64_t n) {\n"
            "  #pragma omp parallel for simd if(parallel: n >= 32768)\n"
            "  for (int64_t i = 0; i < n; ++i) {\n"
            "    const float x = a[i], y = b[i];\n"
            f"    out[i] = {call};\n"
            "  }\n"
            "}\n"
        )
    return PRELUDE + "\n".join(kernels)


@cpp_only
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_prelude_helpers_leave_no_out_of_line_copy(tmp_path, monkeypatch):
    from kiln.config import config

    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    lib = build_many([_unit()])[0]
    syms = subprocess.run(["nm", lib._name], capture_output=True, text=True, check=True).stdout
    helpers = [s for s in syms.split() if re.search(r"_ZN2km|kiln_(erf|gelu|silu|max)", s)]
    assert helpers == [], f"helpers compiled out of line: {helpers}"
    # and the unit computes: the two kernels of each helper give the same finite values
    n = 37
    a, b = torch.randn(n), torch.randn(n)
    outs = []
    for k in range(2 * len(CALLS)):
        o = torch.empty(n)
        fn = getattr(lib, f"kiln_inline_test_{k}")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn(o.data_ptr(), a.data_ptr(), b.data_ptr(), n)
        outs.append(o)
    for k, call in enumerate(CALLS):
        assert torch.isfinite(outs[k]).all(), call
        assert torch.equal(outs[k], outs[k + len(CALLS)]), call
