"""Ops Kiln deliberately does not lower, each with its reason.

An op in this table, or any ATen op with no Kiln rule, becomes an ``opaque`` node: the executor
runs it through ATen exactly as eager PyTorch would, and ``kiln.metrics`` counts it by name.
"""

FALLBACK: dict[str, str] = {
    "nonzero": "output shape depends on the data",
    "unique": "output shape depends on the data",
    "_unique2": "output shape depends on the data",
    "unique_consecutive": "output shape depends on the data",
    "unique_dim": "output shape depends on the data",
    "masked_select": "output shape depends on the data",
    "_local_scalar_dense": "returns a Python number: forces a sync",
    "item": "returns a Python number: forces a sync",
    "equal": "returns a Python bool: forces a sync",
    "is_nonzero": "returns a Python bool: forces a sync",
    "linalg_eigh": "iterative LAPACK solver: no Kiln kernel",
    "_linalg_eigh": "iterative LAPACK solver: no Kiln kernel",
    "linalg_svd": "iterative LAPACK solver: no Kiln kernel",
    "_linalg_svd": "iterative LAPACK solver: no Kiln kernel",
    "linalg_qr": "LAPACK factorization: no Kiln kernel",
    "_linalg_det": "LAPACK factorization: no Kiln kernel",
    "linalg_lu_factor_ex": "LAPACK factorization: no Kiln kernel",
    "_fft_r2c": "FFT: no Kiln kernel",
    "_fft_c2r": "FFT: no Kiln kernel",
    "_fft_c2c": "FFT: no Kiln kernel",
}


def reason(packet: str) -> str:
    return FALLBACK.get(packet, "no Kiln lowering rule for this op yet")
