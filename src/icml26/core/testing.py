"""Test helpers shared by every room: relative-RMS closeness (fla style) and tiny deterministic inputs."""

from __future__ import annotations

import torch


def relative_rms_error(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """``rms(candidate - reference) / rms(reference)``, computed in float64 (0 when both are exactly zero)."""
    ref = reference.detach().double()
    diff = (candidate.detach().double() - ref).pow(2).mean().sqrt()
    scale = ref.pow(2).mean().sqrt()
    if scale == 0:
        return float(diff)
    return float(diff / scale)


def assert_close(name: str, reference: torch.Tensor, candidate: torch.Tensor, ratio: float, *, atol: float = 0.0) -> None:
    """Assert ``candidate`` matches ``reference`` to a relative RMS error of at most ``ratio``.

    A relative RMS tolerance is robust to a few large entries and to the overall scale, which per-element
    ``allclose`` is not (the fla convention for fast-vs-reference kernels). ``atol`` admits tiny absolute
    differences when the reference is (near) zero. Shapes must match exactly; NaNs never pass.
    """
    if reference.shape != candidate.shape:
        raise AssertionError(f"{name}: shape {tuple(candidate.shape)} != reference shape {tuple(reference.shape)}")
    if torch.isnan(candidate).any() != torch.isnan(reference).any():
        raise AssertionError(f"{name}: NaN pattern differs from the reference")
    abs_err = float((candidate.detach().double() - reference.detach().double()).abs().max()) if reference.numel() else 0.0
    err = relative_rms_error(reference, candidate)
    if err > ratio and abs_err > atol:
        raise AssertionError(f"{name}: relative RMS error {err:.3e} > {ratio:.1e} (max abs diff {abs_err:.3e})")


def tiny_tensor(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32, requires_grad: bool = False,
                scale: float = 1.0) -> torch.Tensor:
    """A deterministic standard-normal tensor of ``shape`` (independent of the global RNG)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(*shape, generator=gen, dtype=torch.float64).mul_(scale).to(dtype)
    return out.requires_grad_(requires_grad)


def tiny_tokens(batch: int, length: int, vocab: int, *, seed: int = 0) -> torch.Tensor:
    """Deterministic token ids of shape (batch, length) in ``[0, vocab)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen)
