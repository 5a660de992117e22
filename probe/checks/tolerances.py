"""Tolerances by dtype: how far a value may be from the exact math and still pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: (atol, rtol) by dtype; the coarsest dtype of the record's computation and stored tensors decides.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-7),
    torch.float32: (1e-5, 1e-4),
    torch.float16: (1e-3, 4e-3),
    torch.bfloat16: (4e-3, 1.6e-2),
}

#: A weight above this on a key that may not be attended is a violation (unless ``atol`` is given).
FORBIDDEN_WEIGHT = 1e-6


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    eps: float
    """Unit roundoff of the coarsest dtype (used to allow for rounded scores)."""
    forbidden: float
    """Largest weight tolerated on a key that may not be attended."""
    row_sum: float
    """Largest tolerated |row sum - expected|: ``atol + 2 * eps`` (rounding each weight moves a sum of
    one by at most ``eps``)."""


def tolerance(*dtypes: torch.dtype | None, atol: float | None = None, rtol: float | None = None) -> Tolerance:
    """The tolerance for values computed or stored in ``dtypes`` (the coarsest one decides)."""
    known = [d for d in dtypes if d is not None and d.is_floating_point]
    coarse = max(known, key=lambda d: torch.finfo(d).eps, default=torch.float32)
    default_atol, default_rtol = DEFAULT_TOLERANCES.get(coarse, DEFAULT_TOLERANCES[torch.bfloat16])
    abs_tol = default_atol if atol is None else float(atol)
    eps = torch.finfo(coarse).eps / 2  # unit roundoff
    return Tolerance(
        atol=abs_tol,
        rtol=default_rtol if rtol is None else float(rtol),
        eps=eps,
        forbidden=FORBIDDEN_WEIGHT if atol is None else abs_tol,
        row_sum=abs_tol + 2 * eps,
    )
