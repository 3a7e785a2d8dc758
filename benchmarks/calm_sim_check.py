"""Cheap simulator check (protocol v3 step 0): does the simulated data reward a population model that learned the
shared dynamics over a per-neuron linear AR? POCO-lite / GRU / NLinear trained on pooled pretraining sessions of the
same animals, ridge AR per target session; POCO score on held-out sessions. Writes JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

from icml26.core.io import atomic_write_json
from icml26.methods.calm.baselines import build_baseline
from icml26.methods.calm.model import poco_score, ridge_fit, ridge_predict
from icml26.methods.calm.simulator import SimConfig, simulate_session

CTX, HOR = 48, 16


def windows(dff, stride=16):
    W = CTX + HOR
    return np.stack([dff[:, s:s + W] for s in range(0, dff.shape[1] - W + 1, stride)])


def train(model, traces, steps, lr, seed, batch=16):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for _ in range(steps):
        x = traces[int(torch.randint(len(traces), (1,), generator=gen))]
        st = torch.randint(0, x.shape[1] - CTX - HOR + 1, (batch,), generator=gen).tolist()
        b = torch.stack([x[:, s:s + CTX + HOR] for s in st])
        loss = torch.nn.functional.mse_loss(model(b[..., :CTX]), b[..., CTX:])
        opt.zero_grad(); loss.backward(); opt.step()
    return model


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sim", default="v3", choices=["v3", "legacy"])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--out", default="/tmp/calm_sim_check.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    sim = SimConfig() if a.sim == "v3" else SimConfig.legacy()
    t0 = time.perf_counter()
    pre = [simulate_session(f, k, n_frames=2000, sim=sim) for f in range(3) for k in range(3)]
    tgt = [simulate_session(f, 999, n_frames=2080, sim=sim) for f in range(3)]
    traces = [torch.as_tensor(s.dff) for s in pre]
    res = {"sim": asdict(sim), "sim_hash": sim.hash}
    ar = []
    for s in tgt:
        tr, w = s.dff[:, :480], windows(s.dff[:, 480:])
        pred = np.zeros_like(w[:, :, CTX:])
        for n in range(tr.shape[0]):
            seg = np.lib.stride_tricks.sliding_window_view(tr[n], CTX + HOR)
            pred[:, n] = ridge_predict(ridge_fit(seg[:, :CTX], seg[:, CTX:], 1.0), w[:, n, :CTX])
        ar.append(poco_score(pred, w[:, :, CTX:], w[:, :, CTX - 1]))
    res["ar_linear"] = float(np.mean(ar))
    for name, lr in (("nlinear", 3e-3), ("gru", 3e-3), ("poco", 1e-3)):
        torch.manual_seed(0)
        m = train(build_baseline(name, CTX, HOR, 32), traces, a.steps, lr, 0).eval()
        sc = []
        with torch.no_grad():
            for s in tgt:
                w = torch.as_tensor(windows(s.dff[:, 480:]))
                sc.append(poco_score(m(w[..., :CTX]).numpy(), w[..., CTX:].numpy(), w[..., CTX - 1].numpy()))
        res[name] = float(np.mean(sc))
    res["wall_s"] = time.perf_counter() - t0
    atomic_write_json(a.out, res)
    print(json.dumps({k: v for k, v in res.items() if k != "sim"}))


if __name__ == "__main__":
    sys.exit(main())
