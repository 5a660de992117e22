"""Rotary position embeddings read from the numbers: which pairs of dimensions rotate, at which frequencies, at which
positions. The evidence behind the ``rope_layout``, ``rope_base`` and ``positions`` diagnoses.

RoPE rotates pairs of q/k dimensions by ``position * inv_freq[i]``, ``inv_freq[i] = base ** (-i / P)`` for pair
``i`` of ``P = d_head / 2``. Two pairings are in use: **half** (dims ``i`` and ``i + P``, Hugging Face's
``rotate_half``, GPT-NeoX) and **interleaved** (dims ``2i`` and ``2i + 1``, Meta's original Llama, GPT-J). A
rotation keeps each pair's norm, so:

- both sides rotate the same pairs when the pair norms agree under that pairing; the angle between a reference pair
  and the candidate's is then what differs: growing linearly with the position at a slope that depends on the pair
  (``rope_base``: the frequencies differ, fitted to two bases where they follow ``base ** (-i / P)``), or equal to
  the reference frequencies times a position difference (``positions``: shifted or scaled positions);
- when no pairing keeps the norms, re-rotating the reference from one pairing to the other at a fitted base
  reproduces the candidate (``rope_layout``); the candidate may also be the reference with its dims reordered from
  one pairing to the other (weights permuted as Hugging Face's Llama conversion does: the same attention).

Shapes: q or k ``(batch, head, position, d_head)``, float64; positions ``(position,)``.
"""

from __future__ import annotations

import math

import torch

PAIRINGS = ("half", "interleaved")
#: log10 of the RoPE bases tried when fitting (1 to 10^7).
_LOG_BASES = torch.linspace(0.0, 7.0, 701, dtype=torch.float64)
_FIT_POSITIONS = 32  # positions used to fit a base or shifts; the fit is then checked on every position


def pair_index(d: int, pairing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two dims of each pair: ``(P,)`` and ``(P,)``."""
    p = d // 2
    if pairing == "half":
        return torch.arange(p), torch.arange(p) + p
    return torch.arange(0, 2 * p, 2), torch.arange(1, 2 * p, 2)


def as_complex(x: torch.Tensor, pairing: str) -> torch.Tensor:
    """``(..., d)`` -> ``(..., P)`` complex: pair ``i`` as ``x[a_i] + 1j * x[b_i]``."""
    a, b = pair_index(x.shape[-1], pairing)
    return torch.complex(x[..., a], x[..., b])


def from_complex(z: torch.Tensor, pairing: str, d: int) -> torch.Tensor:
    a, b = pair_index(d, pairing)
    out = torch.empty(*z.shape[:-1], d, dtype=torch.float64)
    out[..., a], out[..., b] = z.real, z.imag
    return out


def inv_freq(log_base: torch.Tensor | float, pairs: int) -> torch.Tensor:
    """``(..., P)``: RoPE's frequencies for base ``10 ** log_base``."""
    lb = torch.as_tensor(log_base, dtype=torch.float64)
    return torch.pow(10.0, -lb[..., None] * torch.arange(pairs, dtype=torch.float64) / pairs)


def rotate(x: torch.Tensor, angles: torch.Tensor, pairing: str) -> torch.Tensor:
    """``x`` ``(..., T, d)`` with each pair rotated by ``angles`` ``(T, P)``."""
    return from_complex(as_complex(x, pairing) * torch.polar(torch.ones_like(angles), angles), pairing, x.shape[-1])


def _fmt_base(log_base: float) -> str:
    """``10 ** log_base`` to four significant digits, written out: 10,000 rather than 1e+04."""
    return f"{float(f'{10**log_base:.4g}'):,.10g}"


def _layout_permutation(ref: torch.Tensor, cand: torch.Tensor, bar: float):
    """The candidate is the reference with dims reordered from one pairing to the other."""
    d = ref.shape[-1]
    for src, dst in (("half", "interleaved"), ("interleaved", "half")):
        a_s, b_s = pair_index(d, src)
        a_d, b_d = pair_index(d, dst)
        perm = torch.empty(d, dtype=torch.long)
        perm[a_d], perm[b_d] = a_s, b_s
        residual = float((cand - ref[..., perm]).abs().max())
        if residual <= bar:
            return (
                "rope_layout",
                f"the candidate's values are the reference's with the dims reordered from {src} pairs to {dst} pairs "
                f"(largest residual {residual:.2g}): the same attention with q/k weights permuted between the two "
                "RoPE pairings (as Hugging Face's Llama conversion permutes them)",
                {"reference": src, "candidate": dst, "permuted": True, "residual": residual},
            )
    return None


def _unwrap(phi: torch.Tensor) -> torch.Tensor:
    """Unwrap angles along axis 0 (consecutive positions)."""
    step = torch.remainder(phi.diff(dim=0) + math.pi, 2 * math.pi) - math.pi
    return torch.cat([phi[:1], phi[:1] + step.cumsum(0)], 0)


def _relative_angles(zr: torch.Tensor, zc: torch.Tensor) -> torch.Tensor:
    """``(T, P)``: the angle from the reference's pairs to the candidate's, over every batch row and head."""
    u = (zc * zr.conj()).sum(dim=(0, 1))  # (T, P)
    return torch.angle(u)


def _classify_slopes(slopes: torch.Tensor, pairing: str):
    """Angle differences ``slope[i] * position``: other frequencies (two bases) or scaled positions."""
    pairs = slopes.shape[0]
    top = float(slopes.abs().max())
    freq = inv_freq(_LOG_BASES, pairs)  # (bases, P)
    k = (freq * slopes).sum(-1) / (freq * freq).sum(-1)  # scaled positions: slopes = k * inv_freq
    err = (slopes - k[:, None] * freq).abs().max(-1).values
    best = int(err.argmin())
    if float(err[best]) <= 0.02 * top and abs(float(k[best])) > 0:
        factor = 1 + float(k[best])
        return (
            "positions",
            f"under {pairing} pairs the candidate's rotation angles are the reference's times {factor:.4g} at every "
            f"pair (RoPE base {_fmt_base(float(_LOG_BASES[best]))}, fitted): the same frequencies at scaled positions",
            {"pairing": pairing, "position_factor": factor, "base": 10 ** float(_LOG_BASES[best])},
        )
    ref_lb, cand_lb, fit_err = _fit_bases(slopes)
    slopes_text = ", ".join(f"{s:.3g}" for s in slopes[:6].tolist()) + (", ..." if pairs > 6 else "")
    details: dict[str, object] = {"pairing": pairing, "slopes": slopes.tolist()}
    text = (
        f"under {pairing} pairs the pair norms agree and the angle between the two grows linearly with the position, "
        f"at a slope that depends on the pair ({slopes_text} rad per position): the rotation frequencies differ"
    )
    if fit_err <= 0.02 * top:
        ref_base, cand_base = 10**ref_lb, 10**cand_lb
        details.update(reference_base=ref_base, candidate_base=cand_base)
        text += (
            f", as RoPE bases {_fmt_base(ref_lb)} (reference) and {_fmt_base(cand_lb)} (candidate) give them (fitted)"
        )
    return "rope_base", text, details


def _fit_bases(slopes: torch.Tensor) -> tuple[float, float, float]:
    """The two RoPE bases (log10) whose frequency differences best give ``slopes`` (candidate minus reference)."""
    pairs = slopes.shape[0]

    def best(ref_lbs, cand_lbs):
        diff = inv_freq(cand_lbs, pairs)[None, :, :] - inv_freq(ref_lbs, pairs)[:, None, :]  # (ref, cand, P)
        err = (diff - slopes).abs().max(-1).values
        i, j = divmod(int(err.argmin()), len(cand_lbs))
        return float(ref_lbs[i]), float(cand_lbs[j]), float(err[i, j])

    coarse = _LOG_BASES[::5]
    ref_lb, cand_lb, _ = best(coarse, coarse)
    around = torch.linspace(-0.05, 0.05, 101, dtype=torch.float64)
    return best(ref_lb + around, cand_lb + around)


def _shifted_positions(zr, zc, positions, bar, pairing):
    """The candidate's angles are the reference frequencies at other (integer) positions: fit the base and a shift
    per position on the first positions."""
    n = min(zr.shape[2], _FIT_POSITIONS)
    u = (zc[:, :, :n] * zr[:, :, :n].conj()).sum(dim=(0, 1))  # (n, P)
    pairs = u.shape[-1]
    shifts = torch.arange(-4 * n - 8, 4 * n + 9, dtype=torch.float64)  # (S,)
    coarse = _LOG_BASES[::5]

    def best(log_bases):
        freq = inv_freq(log_bases, pairs)  # (bases, P)
        angle = -shifts[None, :, None] * freq[:, None, :]
        phase = torch.polar(torch.ones_like(angle), angle)  # (bases, S, P)
        score = (u[None, :, None, :] * phase[:, None]).real.sum(-1)  # (bases, n, S)
        top, where = score.max(-1)  # (bases, n)
        k = int(top.sum(-1).argmax())
        return float(log_bases[k]), shifts[where[k]]

    lb, _ = best(coarse)
    lb, shift = best(torch.linspace(lb - 0.05, lb + 0.05, 101, dtype=torch.float64))
    if not bool((shift != 0).any()):
        return None
    angles = shift[:, None] * inv_freq(lb, pairs)  # (n, P)
    residual = float((zc[:, :, :n] - zr[:, :, :n] * torch.polar(torch.ones_like(angles), angles)).abs().max())
    if residual > bar:
        return None
    if bool((shift == shift[0]).all()):
        shown = f"shifted by {int(shift[0])}"
    else:
        shown = "shifted by " + ", ".join(str(int(s)) for s in shift[:8].tolist()) + (", ..." if n > 8 else "")
        shown += f" at positions {int(positions[0])}, {int(positions[min(1, n - 1)])}, ..."
    return (
        "positions",
        f"under {pairing} pairs the pair norms agree and the candidate's rotation is the reference's at positions "
        f"{shown} (RoPE base {_fmt_base(lb)}, fitted; largest residual {residual:.2g} on the first {n} positions): the "
        "positions differ",
        {"pairing": pairing, "shifts": [int(s) for s in shift.tolist()], "base": 10**lb, "residual": residual},
    )


def _same_pairing(ref, cand, positions, bar):
    """Both rotate the same pairs (the pair norms agree); the angles differ."""
    for pairing in PAIRINGS:
        zr, zc = as_complex(ref, pairing), as_complex(cand, pairing)  # (batch, head, T, P)
        if float((zc.abs() - zr.abs()).abs().max()) > bar:
            continue
        order = torch.argsort(positions)
        p = positions[order]
        phi = _unwrap(_relative_angles(zr, zc)[order])  # (T, P)
        slopes = (p[:, None] * phi).sum(0) / (p * p).sum().clamp_min(1e-12)  # (P,)
        angles = positions[:, None] * slopes  # (T, P)
        residual = float((zc - zr * torch.polar(torch.ones_like(angles), angles)).abs().max())
        if residual <= bar and float(slopes.abs().max()) > 0:
            return _classify_slopes(slopes, pairing)
        return _shifted_positions(zr, zc, positions, bar, pairing)
    return None


def _other_pairing(ref, cand, positions, bar):
    """Re-rotating the reference from one pairing to the other at a fitted base gives the candidate."""
    n = min(ref.shape[2], _FIT_POSITIONS)
    pairs = ref.shape[-1] // 2
    r_fit, c_fit, p_fit = ref[:1, :, :n], cand[:1, :, :n], positions[:n]

    def residual(log_base: float, src: str, dst: str, r, c, p) -> float:
        angles = p[:, None] * inv_freq(log_base, pairs)  # (T, P)
        return float((c - rotate(rotate(r, -angles, src), angles, dst)).abs().max())

    for src, dst in (("half", "interleaved"), ("interleaved", "half")):
        errs = torch.tensor([residual(float(lb), src, dst, r_fit, c_fit, p_fit) for lb in _LOG_BASES[::2]])
        lb = float(_LOG_BASES[::2][int(errs.argmin())])
        fine = torch.linspace(lb - 0.01, lb + 0.01, 41, dtype=torch.float64)
        errs = torch.tensor([residual(float(x), src, dst, r_fit, c_fit, p_fit) for x in fine])
        lb = float(fine[int(errs.argmin())])
        err = residual(lb, src, dst, ref, cand, positions)
        if err <= bar:
            return (
                "rope_layout",
                f"no pairing keeps the pair norms, and re-rotating the reference from {src} pairs to {dst} pairs "
                f"(RoPE base {_fmt_base(lb)}, fitted) reproduces the candidate (largest residual {err:.2g}): the two "
                "rotate different pairs of dimensions",
                {"reference": src, "candidate": dst, "base": 10**lb, "residual": err},
            )
    return None


def explain_rotation(ref: torch.Tensor, cand: torch.Tensor, positions: torch.Tensor, bar: float):
    """``(name, evidence, details)`` when a RoPE difference explains ``cand`` vs ``ref`` within ``bar``, else None."""
    if ref.shape[-1] % 2 or ref.shape[-1] < 2:
        return None
    positions = positions.to(torch.float64)
    return (
        _layout_permutation(ref, cand, bar)
        or _same_pairing(ref, cand, positions, bar)
        or _other_pairing(ref, cand, positions, bar)
    )
