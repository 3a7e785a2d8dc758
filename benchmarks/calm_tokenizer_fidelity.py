"""Tokenizer fidelity (issue 14): reconstruction R^2 = 1 - MSE/Var on held-out single-neuron patches of simulated
dF/F (protocol v3 simulator) for the learned VQ-VAE, FSQ and residual-VQ tokenizers, k-means and Chronos-style
scalar quantisation, plus code usage (perplexity of the code frequencies) and fit time. Writes JSON.
``--kinds`` picks the tokenizers (FSQ needs K without prime factors above 8); ``--rvq-stages`` the RVQ depth."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from icml26.core.io import atomic_write_json
from icml26.methods.calm.model import fit_tokenizer, patchify, reconstruction_r2, scalar_quantize
from icml26.methods.calm.simulator import SimConfig, simulate_session


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--codebook-size", type=int, default=64)
    ap.add_argument("--patch-len", type=int, default=8)
    ap.add_argument("--steps", type=int, nargs="+", default=[300, 1500])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--kinds", nargs="+", default=["kmeans", "vqvae", "fsq", "rvq"])
    ap.add_argument("--rvq-stages", type=int, default=2)
    ap.add_argument("--out", default="results/benchmarks/calm_tokenizer_fidelity.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    P, K, rows = a.patch_len, a.codebook_size, []
    for seed in range(a.seeds):
        pre = [simulate_session(f, seed * 1000 + k, n_frames=2000, sim=SimConfig()) for f in range(3) for k in range(3)]
        fit = torch.cat([patchify(torch.as_tensor(s.dff), P).reshape(-1, P) for s in pre])
        test = torch.cat([patchify(torch.as_tensor(simulate_session(f, seed * 1000 + 999, n_frames=2000).dff), P)
                          .reshape(-1, P) for f in (0, 3)])  # a held-out session and a held-out animal
        lo, hi = float(fit.quantile(0.005)), float(fit.quantile(0.995))
        rows.append({"seed": seed, "tokenizer": f"scalar_{K}_levels_per_frame", "bits_per_patch": P * np.log2(K),
                     "r2": reconstruction_r2(scalar_quantize(test, K, lo, hi), test)})
        for kind in a.kinds:
            for steps in ([0] if kind == "kmeans" else a.steps):
                t0 = time.perf_counter()
                tok = fit_tokenizer(kind, fit, K, seed=seed, steps=steps, stages=a.rvq_stages)
                codes = tok.encode(test)
                p = torch.bincount(codes.flatten(), minlength=K).double()
                p = p[p > 0] / p.sum()
                rows.append({"seed": seed, "tokenizer": kind, "steps": steps,
                             "stages": a.rvq_stages if kind == "rvq" else 1, "bits_per_patch": float(np.log2(K)),
                             "r2": reconstruction_r2(tok.decode(codes), test),
                             "codes_used": int(len(p)), "perplexity": float(torch.exp(-(p * p.log()).sum())),
                             "fit_s": time.perf_counter() - t0})
                print(json.dumps(rows[-1]), flush=True)
    atomic_write_json(a.out, {"codebook_size": K, "patch_len": P, "sim_hash": SimConfig().hash,
                              "torch_threads": torch.get_num_threads(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
