"""Step time and peak memory of SALAAD training against plain training of the same TinyLM.

Each (model, arm) pair runs in its own subprocess so that ``ru_maxrss`` is that pair's true peak. The SALAAD arm adds
the coupled penalty to every step and runs the ADMM block every ``num_freq`` steps on every 2-D weight (official
defaults); its steps are timed separately with and without the ADMM block, and the amortised mean is reported.
The worker also times one ADMM block with equal shapes batched (the hook's path) against one SVD call per block.
Writes one JSON file atomically.

    python benchmarks/salaad_step.py --models tiny small --steps 10 --out results/benchmarks/salaad_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ARMS = ("plain", "salaad")

BENCH = {"room": "salaad", "args": ["--models", "tiny", "--steps", "10"],
         "seconds": 25,
         "ratios": {"SALAAD / plain mean step, tiny LM": "rows[arm=salaad].mean_step_ratio_to_plain"}}
MODELS = {
    # name: (d_model, n_layers, n_heads, seq_len, batch)
    "tiny": (128, 4, 4, 256, 8),
    "small": (384, 6, 6, 256, 8),
}


def worker(model_name: str, arm: str, steps: int, num_freq: int) -> dict:
    import torch

    from icml26.core.memory import current_rss_bytes, optimizer_state_bytes
    from icml26.methods.salaad import SALAAD, SALAADConfig
    from icml26.models.tiny_lm import TinyLM, TinyLMConfig

    d, layers, heads, seq, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(d_model=d, n_layers=layers, n_heads=heads, max_seq_len=seq))
    ids = torch.randint(0, 256, (batch, seq + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    hook = SALAAD(model, config=SALAADConfig(num_freq=num_freq)) if arm == "salaad" else None
    base_rss = current_rss_bytes()

    def step() -> bool:
        _, loss = model(ids[:, :-1], ids[:, 1:])
        if hook is not None:
            loss = loss + hook.penalty()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return hook.step() if hook is not None else False

    for _ in range(num_freq):
        step()
    plain_times, admm_times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        ran = step()
        (admm_times if ran else plain_times).append(time.perf_counter() - start)
    out = {"model": model_name, "arm": arm, "n_params": sum(p.numel() for p in model.parameters()),
           "step_s_median": statistics.median(plain_times + admm_times),
           "step_s_mean": statistics.fmean(plain_times + admm_times),
           "step_s_without_admm_median": statistics.median(plain_times) if plain_times else None,
           "step_s_with_admm_median": statistics.median(admm_times) if admm_times else None,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "rss_after_model_bytes": base_rss, "optimizer_state_bytes": optimizer_state_bytes(opt)}
    if hook is not None:
        out["salaad_state_bytes"] = sum(t.numel() * t.element_size() for b in hook.blocks.values()
                                        for t in (b.L, b.S, b.Y))
        out["n_blocks"] = len(hook.blocks)
        snapshot = hook.state_dict()
        start = time.perf_counter()
        hook.admm_update()
        out["admm_block_batched_s"] = time.perf_counter() - start
        hook.load_state_dict(snapshot)
        start = time.perf_counter()
        with torch.no_grad():
            for b in hook.blocks.values():
                hook._update_group([b])
        out["admm_block_per_block_s"] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-freq", type=int, default=2)
    parser.add_argument("--out", default="results/benchmarks/salaad_step.json")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "ARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.steps, args.num_freq)))
        return
    rows = []
    for model_name in args.models:
        for arm in ARMS:
            proc = subprocess.run([sys.executable, __file__, "--worker", model_name, arm, "--steps", str(args.steps),
                                   "--num-freq", str(args.num_freq)], capture_output=True, text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"{model_name:6s} {arm:7s} mean step {rows[-1]['step_s_mean'] * 1e3:8.1f} ms  "
                  f"peak {rows[-1]['peak_rss_bytes'] / 2**20:7.0f} MiB", flush=True)
    for row in rows:
        plain = next(r for r in rows if r["model"] == row["model"] and r["arm"] == "plain")
        row["mean_step_ratio_to_plain"] = row["step_s_mean"] / plain["step_s_mean"]
        row["peak_rss_ratio_to_plain"] = row["peak_rss_bytes"] / plain["peak_rss_bytes"]
    from icml26.core.io import atomic_write_json

    result = {"benchmark": "salaad_step", "steps": args.steps, "num_freq": args.num_freq,
              "models": {m: MODELS[m] for m in args.models}, "platform": platform.platform(),
              "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "rows": rows}
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
