"""Simulated calcium-imaging sessions: shared latent dynamics -> Poisson spikes -> indicator kinetics -> raw
fluorescence (saturation, neuropil, drift, bleaching, noise) -> Suite2p-like preprocessing to dF/F.

Sessions of one *family* (an "animal") share the latent dynamics, the behaviour readout and the indicator family;
every session draws new neurons, new baselines and new nuisance signals. Every realism ingredient of the room notes
(rl-federated-science.md 5.4) is a :class:`SimConfig` switch; ``SimConfig.legacy()`` turns them all off and
reproduces protocol v1/v2's data bit for bit. Deterministic given (family, session_seed, SimConfig);
``Session.content_hash`` fingerprints the config and the arrays so results can cite exactly which data they used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np
from scipy.signal import lfilter

DYNAMICS = ("switching", "nonlinear")
INDICATORS = ("ar1", "ar2")
DFF_MODES = ("zscore", "percentile")
# indicator families (notes 5.4): tau_rise, tau_decay in s, single-AP dF/F; families alternate 6s / 6f
GCAMP = {"6s": {"tau_r": (0.1, 0.2), "tau_d": (1.0, 2.0), "amp": (0.1, 0.3)},
         "6f": {"tau_r": (0.05, 0.05), "tau_d": (0.3, 0.6), "amp": (0.05, 0.15)}}


@dataclass(frozen=True)
class SimConfig:
    """Which realism ingredients the simulator applies. Defaults: every ingredient on (protocol v3).

    dynamics: "nonlinear" = a rate RNN x_{t+1} = (1-a) x_t + a J tanh(x_t) + w_t with J shared by the family
        (gain ``rnn_gain``; chaotic / limit-cycle regimes that a linear AR cannot extrapolate), or "switching" =
        two linear rotation regimes with a Markov switch (v1/v2).
    indicator: "ar2" = rise and decay (difference of exponentials), GCaMP6s for even families and GCaMP6f for
        odd ones; "ar1" = decay only with tau_d in [0.8, 1.5] s (v1/v2).
    saturation: Hill saturation h(c) = K c^n / (c^n + K^n), n = 2.2, K = 4 spike-equivalents.
    neuropil: true contamination coefficient drawn in [0.8, 1.0]; the pipeline subtracts 0.7 of the observed
        neuropil trace, leaving residual contamination 0.1-0.3 of a shared smooth signal. 0 disables.
    drift_sd: log-amplitude of a slow low-pass random-walk baseline drift (0 disables).
    bleaching: fraction of the baseline lost to exponential photobleaching over the session (0 disables).
    behavior_fraction: fraction of neurons with a gain on the behaviour variable u_t (0 disables).
    behavior_gain: multiplies those neurons' gains g_n ~ U[0.5, 1.5] (1 = protocol v3; the decoding claim's v2
        design raises it so the behaviour is decodable from single sessions at all).
    burn_in: frames of latent dynamics simulated and discarded before frame 0 (0 = protocol v3, whose sessions
        start with the transient from x_0 ~ N(0, I), several times the stationary scale, so the session-wide
        standardisation of x and the behaviour are dominated by the first ~5 s).
    dff: "percentile" = dF/F with F0 the running 8th percentile over 30 s, then z-score; "zscore" = z-score the
        raw trace (v1/v2).
    noise_sd: Gaussian noise sd in units of one action potential's fluorescence (1 / single-spike SNR).
    """

    dynamics: str = "nonlinear"
    indicator: str = "ar2"
    saturation: bool = True
    neuropil: bool = True
    drift_sd: float = 0.1
    bleaching: float = 0.2
    behavior_fraction: float = 0.25
    behavior_gain: float = 1.0
    burn_in: int = 0
    dff: str = "percentile"
    noise_sd: float = 0.3
    coupling: float = 1.2
    latent_dim: int = 6
    rnn_gain: float = 2.0

    def __post_init__(self) -> None:
        for name, allowed in (("dynamics", DYNAMICS), ("indicator", INDICATORS), ("dff", DFF_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"SimConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("drift_sd", "bleaching", "behavior_fraction", "behavior_gain", "noise_sd", "coupling",
                     "rnn_gain"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"SimConfig.{name} must be a finite number >= 0, got {v!r}")
        if self.bleaching >= 1 or self.behavior_fraction > 1:
            raise ValueError(f"SimConfig.bleaching must be < 1 and behavior_fraction <= 1, got {self.bleaching!r}, "
                             f"{self.behavior_fraction!r}")
        if not (isinstance(self.burn_in, int) and not isinstance(self.burn_in, bool) and self.burn_in >= 0):
            raise ValueError(f"SimConfig.burn_in must be an integer >= 0, got {self.burn_in!r}")
        if not (isinstance(self.latent_dim, int) and self.latent_dim >= 2 and self.latent_dim % 2 == 0):
            raise ValueError(f"SimConfig.latent_dim must be an even integer >= 2, got {self.latent_dim!r}")

    @classmethod
    def legacy(cls, **kw) -> "SimConfig":
        """Protocol v1/v2's simulator: switching linear dynamics, AR(1) calcium, z-scored raw traces, no nuisance."""
        return cls(**{"dynamics": "switching", "indicator": "ar1", "saturation": False, "neuropil": False,
                      "drift_sd": 0.0, "bleaching": 0.0, "behavior_fraction": 0.0, "dff": "zscore", **kw})

    @property
    def hash(self) -> str:
        d = asdict(self)
        for k, neutral in (("behavior_gain", 1.0), ("burn_in", 0)):  # added after v3: at their neutral values
            if d[k] == neutral:                                     # the v3 hash (cited by results) holds
                del d[k]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Session:
    """One simulated recording. Shapes: dff/calcium/spikes/rates (N, T); latents (T, D); behavior (T,).

    ``calcium`` is the indicator state c (spike units, before saturation and nuisance); ``kernel`` the AR
    coefficients (gamma,) or (g1, g2) with c_t = g1 c_{t-1} + g2 c_{t-2} + s_t; ``gamma`` the decay factor.
    """

    dff: np.ndarray
    spikes: np.ndarray
    calcium: np.ndarray
    rates_hz: np.ndarray
    latents: np.ndarray
    behavior: np.ndarray
    gamma: float
    fs: float
    family: int
    kernel: tuple = ()
    indicator: str = "ar1"
    sim_hash: str = ""

    @property
    def content_hash(self) -> str:
        h = hashlib.sha256(self.sim_hash.encode())
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


def family_dynamics(family: int, latent_dim: int = 6, *, rnn_gain: float = 2.0) -> dict:
    """The shared part of a family: two linear regimes and a switch (v1/v2), the RNN coupling J (v3), a behaviour
    readout, tau_decay (AR(1)) and the indicator family with its kinetics (AR(2))."""
    if latent_dim < 2 or latent_dim % 2:
        raise ValueError(f"latent_dim must be an even integer >= 2, got {latent_dim!r}")
    rng = np.random.default_rng(1_000 + family)
    fam = {"A": [_rotation(rng, latent_dim, (0.95, 0.995)) for _ in range(2)],
           "stay": 0.98, "w_beh": rng.standard_normal(latent_dim) / np.sqrt(latent_dim),
           "tau_decay_s": float(rng.uniform(0.8, 1.5))}
    # v3 ingredients draw from their own stream so the v1/v2 draws above stay unchanged
    rng3 = np.random.default_rng([2_000, family])
    fam["J"] = rnn_gain * rng3.standard_normal((latent_dim, latent_dim)) / np.sqrt(latent_dim)
    ind = "6s" if family % 2 == 0 else "6f"
    fam["gcamp"] = ind
    fam["tau_r"], fam["tau_d"] = (float(rng3.uniform(*GCAMP[ind][k])) for k in ("tau_r", "tau_d"))
    return fam


def _lowpass_walk(rng: np.random.Generator, shape: tuple, alpha: float) -> np.ndarray:
    """A slow random walk: white noise through a one-pole low-pass, unit sd per row; shape (R, T)."""
    w = lfilter([alpha], [1.0, alpha - 1.0], rng.standard_normal(shape), axis=-1)
    return (w - w.mean(-1, keepdims=True)) / w.std(-1, keepdims=True).clip(1e-9)


def running_percentile(f: np.ndarray, window: int, q: float = 8.0) -> np.ndarray:
    """F0: the ``q``-th percentile over a centred window of ``window`` frames, per row of f (N, T).

    Evaluated every window/10 frames and linearly interpolated in between (Suite2p's baseline is as smooth)."""
    N, T = f.shape
    half, step = window // 2, max(1, window // 10)
    centres = np.arange(0, T, step)
    vals = np.stack([np.percentile(f[:, max(0, c - half):c + half + 1], q, axis=1) for c in centres], 1)
    return np.stack([np.interp(np.arange(T), centres, v) for v in vals])


def simulate_session(family: int, session_seed: int, *, n_neurons: int = 32, n_frames: int = 3000,
                     fs: float = 10.0, sim: SimConfig | None = None, latent_dim: int | None = None,
                     noise_sd: float | None = None, spike_amp: float = 1.0, coupling: float | None = None) -> Session:
    """Simulate one session of ``n_neurons`` neurons for ``n_frames`` frames at ``fs`` Hz under ``sim``.

    Latents x (T, D) follow the family's dynamics and are standardised; lambda_n = b_n softplus(k c_n.x_t + g_n u~_t
    - 1)/softplus(-1) with sparse unit-norm loadings c_n and lognormal b_n in [0.1, 5] Hz; s ~ Poisson(lambda/fs);
    indicator state c from the AR(1)/AR(2) kernel; F = F0_n(t) (1 + amp_n h(c)) + neuropil + noise; preprocessing
    to dF/F and a per-neuron z-score (POCO's normalisation). Behaviour u_t = softplus(w.x_t) (running speed).
    ``latent_dim``, ``noise_sd`` and ``coupling`` override the SimConfig fields of the same name.
    """
    for name, v in (("n_neurons", n_neurons), ("n_frames", n_frames)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 2):
            raise ValueError(f"{name} must be an integer >= 2, got {v!r}")
    if not (isinstance(fs, (int, float)) and fs > 0):
        raise ValueError(f"fs must be > 0, got fs={fs!r}")
    if noise_sd is not None and not noise_sd >= 0:
        raise ValueError(f"noise_sd must be >= 0, got noise_sd={noise_sd!r}")
    over = {k: v for k, v in (("latent_dim", latent_dim), ("noise_sd", noise_sd), ("coupling", coupling))
            if v is not None}
    sim = SimConfig(**{**asdict(sim or SimConfig()), **over})
    D = sim.latent_dim
    fam = family_dynamics(family, D, rnn_gain=sim.rnn_gain)
    rng = np.random.default_rng([family, session_seed])
    rng3 = np.random.default_rng([family, session_seed, 3])  # v3 ingredients: a separate stream
    n_lat = n_frames + sim.burn_in
    x = np.zeros((n_lat, D))
    x[0] = rng.standard_normal(D)
    z = 0
    noise = rng.standard_normal((n_lat, D)) * 0.15
    flips = rng.random(n_lat) > fam["stay"]
    if sim.dynamics == "switching":
        for t in range(1, n_lat):
            z = 1 - z if flips[t] else z
            x[t] = fam["A"][z] @ x[t - 1] + noise[t]
    else:
        a = 1.0 / (fs * 1.0)  # RNN time constant 1 s
        J = fam["J"]
        for t in range(1, n_lat):
            x[t] = (1 - a) * x[t - 1] + a * J @ np.tanh(x[t - 1]) + np.sqrt(a) * noise[t]
    x = x[sim.burn_in:]
    x = (x - x.mean(0)) / x.std(0).clip(1e-9)
    loadings = rng.standard_normal((n_neurons, D)) * (rng.random((n_neurons, D)) < 0.5)
    loadings /= np.maximum(np.linalg.norm(loadings, axis=1, keepdims=True), 1e-6)
    base_hz = np.exp(rng.normal(np.log(1.0), 0.6, n_neurons)).clip(0.1, 5.0)
    behavior = np.logaddexp(0.0, x @ fam["w_beh"])
    drive = sim.coupling * x @ loadings.T - 1.0
    if sim.behavior_fraction > 0:
        gain = (rng3.random(n_neurons) < sim.behavior_fraction) * rng3.uniform(0.5, 1.5, n_neurons)
        gain = gain * sim.behavior_gain
        drive = drive + ((behavior - behavior.mean()) / behavior.std().clip(1e-9))[:, None] * gain
    rates = base_hz * np.logaddexp(0.0, drive) / np.log1p(np.exp(-1.0))
    spikes = rng.poisson(rates / fs).astype(float)
    gamma = float(np.exp(-1.0 / (fs * (fam["tau_decay_s"] if sim.indicator == "ar1" else fam["tau_d"]))))
    if sim.indicator == "ar1":
        kernel = (gamma,)
    else:  # difference of exponentials: (1 - g_d q)(1 - g_r q) c = s
        g_r = float(np.exp(-1.0 / (fs * fam["tau_r"])))
        kernel = (gamma + g_r, -gamma * g_r)
    calcium = lfilter([1.0], [1.0, *(-k for k in kernel)], spikes, axis=0)
    if sim.dynamics == "switching" and sim.indicator == "ar1" and sim.dff == "zscore" and not (
            sim.saturation or sim.neuropil or sim.drift_sd or sim.bleaching):
        raw = spike_amp * calcium + sim.noise_sd * rng.standard_normal(calcium.shape)  # v1/v2 exactly
    else:
        T = n_frames
        amp = rng3.uniform(*GCAMP[fam["gcamp"]]["amp"], n_neurons) * spike_amp  # dF/F of one AP
        h = 4.0 * calcium ** 2.2 / (calcium ** 2.2 + 4.0 ** 2.2) if sim.saturation else calcium
        f0 = np.exp(rng3.normal(np.log(100.0), 0.3, n_neurons))[None, :] * np.ones((T, 1))
        if sim.drift_sd:
            f0 = f0 * np.exp(sim.drift_sd * _lowpass_walk(rng3, (n_neurons, T), 1.0 / (60 * fs)).T)
        if sim.bleaching:
            f0 = f0 * (1 - sim.bleaching) ** (np.arange(T) / T)[:, None]
        raw = f0 * (1 + amp * h) + sim.noise_sd * amp * f0 * rng3.standard_normal((T, n_neurons))
        if sim.neuropil:
            shared = _lowpass_walk(rng3, (1, T), 1.0 / (2 * fs))[0]
            f_np = 50.0 * (1 + 0.1 * shared + 0.05 * calcium.mean(1))
            f_np_obs = f_np + 0.5 * rng3.standard_normal(T)  # the surround mask's own noise
            raw = raw + rng3.uniform(0.8, 1.0, n_neurons) * f_np[:, None] - 0.7 * f_np_obs[:, None]
        if sim.dff == "percentile":
            base = running_percentile(raw.T, int(30 * fs)).T
            raw = (raw - base) / base
    dff = (raw - raw.mean(0)) / raw.std(0).clip(1e-6)
    return Session(dff=dff.T.astype(np.float32), spikes=spikes.T, calcium=calcium.T, rates_hz=rates.T,
                   latents=x, behavior=behavior, gamma=gamma, fs=fs, family=family, kernel=kernel,
                   indicator=sim.indicator if sim.indicator == "ar1" else fam["gcamp"], sim_hash=sim.hash)
