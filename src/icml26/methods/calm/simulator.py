"""Simulated calcium-imaging sessions: switching latent dynamics -> Poisson spikes -> AR(1) calcium -> dF/F.

Sessions of one *family* (an "animal") share the latent dynamics (two rotation regimes and a Markov switch) and the
behaviour readout; every session draws new neurons, new baselines and a new noise level. Deterministic given
(family, session_seed); ``content_hash`` fingerprints the arrays so results can cite exactly which data they used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from scipy.signal import lfilter


@dataclass(frozen=True)
class Session:
    """One simulated recording. Shapes: dff/calcium/spikes/rates (N, T); latents (T, D); behavior (T,)."""

    dff: np.ndarray
    spikes: np.ndarray
    calcium: np.ndarray
    rates_hz: np.ndarray
    latents: np.ndarray
    behavior: np.ndarray
    gamma: float
    fs: float
    family: int

    @property
    def content_hash(self) -> str:
        h = hashlib.sha256()
        for a in (self.dff, self.spikes, self.latents, self.behavior):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]


def _rotation(rng: np.random.Generator, dim: int, moduli: tuple[float, float]) -> np.ndarray:
    """Block-diagonal 2x2 rotations with eigen-moduli in ``moduli``, in a random orthonormal basis."""
    blocks = np.zeros((dim, dim))
    for i in range(0, dim, 2):
        r, th = rng.uniform(*moduli), rng.uniform(0.05, 0.4)
        blocks[i:i + 2, i:i + 2] = r * np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
    q, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    return q @ blocks @ q.T


def family_dynamics(family: int, latent_dim: int = 6) -> dict:
    """The shared part of a family: two dynamics regimes, a switch matrix, a behaviour readout, tau_decay."""
    if latent_dim < 2 or latent_dim % 2:
        raise ValueError(f"latent_dim must be an even integer >= 2, got {latent_dim!r}")
    rng = np.random.default_rng(1_000 + family)
    return {"A": [_rotation(rng, latent_dim, (0.95, 0.995)) for _ in range(2)],
            "stay": 0.98, "w_beh": rng.standard_normal(latent_dim) / np.sqrt(latent_dim),
            "tau_decay_s": float(rng.uniform(0.8, 1.5))}


def simulate_session(family: int, session_seed: int, *, n_neurons: int = 32, n_frames: int = 3000,
                     fs: float = 10.0, latent_dim: int = 6, noise_sd: float = 0.3, spike_amp: float = 1.0,
                     coupling: float = 1.2) -> Session:
    """Simulate one session of ``n_neurons`` neurons for ``n_frames`` frames at ``fs`` Hz.

    x_{t+1} = A_{z_t} x_t + w_t (z_t a 2-state Markov chain); lambda_n = b_n softplus(k c_n.x_t + k0)/softplus(k0);
    s ~ Poisson(lambda/fs); c_t = gamma c_{t-1} + s_t with gamma = exp(-1/(fs tau)); dF/F = amp c + noise, then
    z-scored per neuron (as POCO normalises). Behaviour u_t = softplus(w.x_t), a running-speed-like readout.
    """
    for name, v in (("n_neurons", n_neurons), ("n_frames", n_frames)):
        if not (isinstance(v, int) and v >= 2):
            raise ValueError(f"{name} must be an integer >= 2, got {v!r}")
    if not fs > 0 or not noise_sd >= 0:
        raise ValueError(f"fs must be > 0 and noise_sd >= 0, got fs={fs!r}, noise_sd={noise_sd!r}")
    fam = family_dynamics(family, latent_dim)
    rng = np.random.default_rng([family, session_seed])
    x = np.zeros((n_frames, latent_dim))
    x[0] = rng.standard_normal(latent_dim)
    z = 0
    noise = rng.standard_normal((n_frames, latent_dim)) * 0.15
    flips = rng.random(n_frames) > fam["stay"]
    for t in range(1, n_frames):
        z = 1 - z if flips[t] else z
        x[t] = fam["A"][z] @ x[t - 1] + noise[t]
    x = (x - x.mean(0)) / x.std(0)
    loadings = rng.standard_normal((n_neurons, latent_dim)) * (rng.random((n_neurons, latent_dim)) < 0.5)
    loadings /= np.maximum(np.linalg.norm(loadings, axis=1, keepdims=True), 1e-6)
    base_hz = np.exp(rng.normal(np.log(1.0), 0.6, n_neurons)).clip(0.1, 5.0)
    drive = coupling * x @ loadings.T - 1.0
    rates = base_hz * np.logaddexp(0.0, drive) / np.log1p(np.exp(-1.0))
    spikes = rng.poisson(rates / fs).astype(float)
    gamma = float(np.exp(-1.0 / (fs * fam["tau_decay_s"])))
    calcium = lfilter([1.0], [1.0, -gamma], spikes, axis=0)
    raw = spike_amp * calcium + noise_sd * rng.standard_normal(calcium.shape)
    dff = (raw - raw.mean(0)) / raw.std(0).clip(1e-6)
    behavior = np.logaddexp(0.0, x @ fam["w_beh"])
    return Session(dff=dff.T.astype(np.float32), spikes=spikes.T, calcium=calcium.T, rates_hz=rates.T,
                   latents=x, behavior=behavior, gamma=gamma, fs=fs, family=family)
