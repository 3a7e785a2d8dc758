"""Simulated 4-D fMRI inside the real MNI152 brain (nilearn's mask and T1 template, resampled to a CPU-sized grid).

No real fMRI series can be had offline (only templates), so the runs are generated. What a run contains:

* static anatomy: the MNI152 T1 template (so grey/white/CSF boundaries give the spatially heterogeneous
  intensity structure that the variance gate reacts to), times a site gain, plus a smooth site bias field;
* ``n_networks`` networks, each two Gaussian blobs centred in the brain; the first ``n_states`` are task networks
  whose block-design boxcar, convolved with the canonical double-gamma HRF (TR 0.72 s), drives the chunk's state;
  every network also has AR(1) resting fluctuations;
* subject effects: maps shifted by up to one voxel, amplitude jitter; trait (binary): resting coupling between the
  last two networks and a 25% larger spatial extent of network 1; age (0..1): all network amplitudes scale by
  (1 - 0.4 age) and grey-matter contrast drops (atrophy-like);
* site effects (3 sites): gain, bias-field direction, noise level;
* spatially smooth noise (FWHM 2 voxels) and thermal noise; then the global z-score inside the mask, 0 outside.

Each chunk is T frames of one block (its state) after a lead-in of 15 frames of another state, so the HRF's rise
and the previous block's tail are both inside the chunk, as in a real block design.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .nifti import mni_on_grid

TR = 0.72


def double_gamma_hrf(tr: float = TR, length_s: float = 30.0) -> np.ndarray:
    """SPM's canonical HRF (peak 6 s, undershoot 16 s, ratio 1/6) sampled every ``tr`` seconds, unit sum."""
    from math import gamma

    t = np.arange(0.0, length_s, tr)
    h = t ** 5 * np.exp(-t) / gamma(6) - t ** 15 * np.exp(-t) / gamma(16) / 6.0
    return h / h.sum()


@dataclass
class SimSpec:
    """Knobs of the simulator (defaults used by the experiments)."""

    shape: tuple[int, int, int] = (32, 40, 32)
    voxel_mm: float = 6.0
    frames: int = 20
    n_networks: int = 6
    n_states: int = 4
    task_amp: float = 0.06
    rest_amp: float = 0.04
    smooth_noise: float = 0.03
    thermal_noise: float = 0.02
    lead_in: int = 15
    smooth_bank: int = 64
    n_sites: int = 3
    blob_sigma: tuple[float, float] = (1.2, 2.5)
    extra: dict = field(default_factory=dict)


@dataclass
class FMRIDataset:
    """Chunks and labels. ``values`` (n, T, V) float32 holds the V brain voxels of each chunk (z-scored in
    ``mask``, 0 outside); :meth:`tensor` expands chunks to (b, T, D, H, W). Labels are per chunk."""

    values: np.ndarray
    state: np.ndarray
    trait: np.ndarray
    age: np.ndarray
    subject: np.ndarray
    site: np.ndarray
    mask: np.ndarray
    affine: np.ndarray

    def __len__(self) -> int:
        return self.values.shape[0]

    def tensor(self, idx=None) -> torch.Tensor:
        """(b, T, D, H, W) float32 chunks (all when ``idx`` is None)."""
        v = torch.from_numpy(self.values if idx is None else self.values[idx])
        if v.ndim == 2:
            v = v[None]
        out = torch.zeros(v.shape[0], v.shape[1], int(self.mask.size), dtype=v.dtype)
        out[:, :, torch.from_numpy(np.flatnonzero(self.mask))] = v
        return out.view(v.shape[0], v.shape[1], *self.mask.shape)


def _smooth(noise: np.ndarray, sigma_vox: float) -> np.ndarray:
    """Gaussian smoothing of (..., D, H, W) fields in the Fourier domain (periodic; fine for noise), unit std."""
    t = torch.from_numpy(noise)
    dims = t.shape[-3:]
    freqs = torch.meshgrid(*[torch.fft.fftfreq(n) for n in dims], indexing="ij")
    k2 = sum(f ** 2 for f in freqs)
    filt = torch.exp(-2 * (np.pi ** 2) * sigma_vox ** 2 * k2)
    out = torch.fft.ifftn(torch.fft.fftn(t, dim=(-3, -2, -1)) * filt, dim=(-3, -2, -1)).real
    return (out / out.std().clamp_min(1e-8)).numpy()


def _blob(shape, centre, sigma) -> np.ndarray:
    zz, yy, xx = np.meshgrid(*[np.arange(n) for n in shape], indexing="ij")
    r2 = (zz - centre[0]) ** 2 + (yy - centre[1]) ** 2 + (xx - centre[2]) ** 2
    return np.exp(-r2 / (2 * sigma ** 2))


def simulate(n_subjects: int, chunks_per_subject: int, seed: int, spec: SimSpec | None = None,
             *, population_seed: int | None = None) -> FMRIDataset:
    """Simulate ``n_subjects * chunks_per_subject`` chunks.

    ``population_seed`` fixes the network atlas (shared by every dataset drawn from the same population; defaults to
    ``seed``); ``seed`` draws subjects, sites, states and noise.
    """
    spec = spec or SimSpec()
    mask, t1, affine = mni_on_grid(spec.shape, spec.voxel_mm)
    pop = np.random.default_rng(population_seed if population_seed is not None else seed)
    rng = np.random.default_rng(seed + 7_919)
    D, H, W = spec.shape
    inside = np.argwhere(mask)
    K, T = spec.n_networks, spec.frames
    centres = inside[pop.choice(len(inside), size=(K, 2))]
    sigmas = pop.uniform(*spec.blob_sigma, size=(K, 2))
    gm = np.exp(-((t1 - 0.55) / 0.15) ** 2) * mask  # grey-matter-like intensity band of the template

    # spatially smooth noise: a bank of FWHM-2-voxel fields drawn once per dataset; each chunk takes T of them with
    # random signs (drawing fresh 3-D fields per frame costs ~10x the rest of the simulator)
    bank = _smooth(rng.standard_normal((spec.smooth_bank, D, H, W)).astype(np.float32), 2.0 / 2.355)[:, mask]
    hrf = double_gamma_hrf(TR)
    L = spec.lead_in + T
    xs, states, traits, ages, subjects, sites = [], [], [], [], [], []
    first_trait = int(rng.integers(2))
    for subj in range(n_subjects):
        trait = (subj + first_trait) % 2  # balanced: alternate subjects carry the trait
        age = float(rng.uniform())
        site = int(rng.integers(spec.n_sites))
        site_rng = np.random.default_rng(10_000 * (population_seed or 0) + site)
        gain = 0.9 + 0.1 * site
        direction = site_rng.normal(size=3)
        direction /= np.linalg.norm(direction)
        grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, n) for n in spec.shape], indexing="ij"), -1)
        bias = 0.05 * np.einsum("dhwc,c->dhw", grid, direction)
        noise_scale = (0.8, 1.0, 1.3)[site % 3]
        shift = rng.integers(-1, 2, size=3)
        maps = np.zeros((K, D, H, W), np.float32)
        for k in range(K):
            for j in range(2):
                sig = sigmas[k, j] * (1.25 if (trait and k == 1) else 1.0)
                maps[k] += _blob(spec.shape, centres[k, j] + shift, sig)
        maps *= mask[None] * rng.normal(1.0, 0.1, size=(K, 1, 1, 1))
        amp = 1.0 - 0.4 * age
        anatomy = gain * (t1 - 0.15 * age * gm) + bias
        coupling = np.eye(K)
        coupling[K - 1, K - 2] = coupling[K - 2, K - 1] = 0.6 if trait else 0.0
        chol = np.linalg.cholesky(coupling + 1e-6 * np.eye(K))
        maps_m = maps[:, mask].astype(np.float32)  # (K, V) on brain voxels only
        maps_t = torch.from_numpy(maps_m)
        anatomy_m = anatomy[mask]
        for _ in range(chunks_per_subject):
            state = int(rng.integers(spec.n_states))
            prev = int(rng.choice([s for s in range(spec.n_states) if s != state]))
            box = np.zeros((K, L))
            box[prev, :spec.lead_in] = 1.0
            box[state, spec.lead_in:] = 1.0
            task = np.stack([np.convolve(b, hrf)[:L] for b in box])[:, -T:] / hrf.max()
            rest = np.zeros((K, L))
            innov = np.einsum("ij,jt->it", chol, rng.normal(size=(K, L)))  # einsum: no BLAS threads
            for t in range(1, L):
                rest[:, t] = 0.9 * rest[:, t - 1] + np.sqrt(1 - 0.81) * innov[:, t]
            ts = amp * (spec.task_amp * task + spec.rest_amp * rest[:, -T:])  # (K, T)
            frames = rng.choice(len(bank), size=T, replace=False)
            signs = rng.choice([-1.0, 1.0], size=(T, 1))
            signal = torch.from_numpy(np.ascontiguousarray(ts.T, dtype=np.float32)) @ maps_t  # torch: one thread
            vals = (signal.numpy() + anatomy_m[None]
                    + noise_scale * (spec.smooth_noise * signs * bank[frames]
                                     + spec.thermal_noise * rng.standard_normal((T, maps_m.shape[1]))))
            z = ((vals - vals.mean()) / vals.std()).astype(np.float32)
            xs.append(z)
            states.append(state)
            traits.append(trait)
            ages.append(age)
            subjects.append(subj)
            sites.append(site)
    return FMRIDataset(values=np.stack(xs), state=np.array(states), trait=np.array(traits), age=np.array(ages),
                       subject=np.array(subjects), site=np.array(sites), mask=mask, affine=affine)
