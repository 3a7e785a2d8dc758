"""Training-step time of a TinyLM with KromHC (n = 4) against the plain residual and mHC (and optionally HC, mHC-lite).

One training step = forward, backward, gradient clipping and an AdamW step on a fixed batch. All models live in one
process and are timed in interleaved rounds (residual, kromhc, mhc, residual, ...), so a change in machine load
hits every arm alike; the ratio to the plain residual is taken within each round and its median is reported.
Target (issue): KromHC at most 1.3x the plain residual. Writes one JSON file atomically.

    python benchmarks/kromhc_step.py --sizes quick full --rounds 12 --out results/benchmarks/kromhc_step.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

SIZES = {
    # The claim's quick tier and full tier models (experiments.py) and a wider one to show the trend with width.
    "quick": {"d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 64, "batch_size": 8},
    "full": {"d_model": 128, "n_layers": 6, "n_heads": 4, "seq_len": 256, "batch_size": 8},
    "wide": {"d_model": 256, "n_layers": 6, "n_heads": 4, "seq_len": 256, "batch_size": 8},
    "xwide": {"d_model": 512, "n_layers": 6, "n_heads": 8, "seq_len": 256, "batch_size": 8},
}
TARGET = 1.3


def build_step(kind: str, size: dict, num_streams: int):
    """A closure running one training step of the ``kind`` model on a fixed batch, and the model's size."""
    from icml26.methods.kromhc import HyperResidual
    from icml26.models.tiny_lm import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    config = TinyLMConfig(d_model=size["d_model"], n_layers=size["n_layers"], n_heads=size["n_heads"],
                          max_seq_len=size["seq_len"])
    model = TinyLM(config, residual=HyperResidual(num_streams, size["d_model"], kind=kind))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (size["batch_size"], size["seq_len"] + 1), generator=gen)

    def step() -> None:
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step, model.num_parameters()


def measure(size_name: str, arms: list[str], rounds: int, num_streams: int) -> dict:
    size = SIZES[size_name]
    steps, params = {}, {}
    for arm in arms:
        steps[arm], params[arm] = build_step(arm, size, num_streams)
        steps[arm]()  # warm-up: first-call allocations and dispatch
    cpu = {arm: [] for arm in arms}
    wall = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm in arms:
            c0, w0 = time.process_time(), time.perf_counter()
            steps[arm]()
            cpu[arm].append(time.process_time() - c0)
            wall[arm].append(time.perf_counter() - w0)
    rows = []
    for arm in arms:
        ratios = [c / r for c, r in zip(cpu[arm], cpu["residual"])]
        rows.append({
            "size": size_name, "arm": arm, "n_params": params[arm], "cpu_ms_median": 1e3 * statistics.median(cpu[arm]),
            "cpu_ms_min": 1e3 * min(cpu[arm]), "wall_ms_median": 1e3 * statistics.median(wall[arm]),
            "ratio_to_residual_median": statistics.median(ratios), "ratio_to_residual_of_min": min(cpu[arm]) /
            min(cpu["residual"]), "cpu_ms_all": [1e3 * c for c in cpu[arm]]})
    return {"size": size_name, **size, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["quick", "full"], choices=sorted(SIZES))
    parser.add_argument("--arms", nargs="+", default=["residual", "kromhc", "mhc"],
                        choices=["residual", "hc", "mhc", "mhc_lite", "kromhc"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--num-streams", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 by default because OpenMP threads on a shared 2-core machine distort "
                             "the timing of small matrices")
    parser.add_argument("--out", default="results/benchmarks/kromhc_step.json")
    args = parser.parse_args()
    arms = ["residual", *[a for a in args.arms if a != "residual"]]
    torch.set_num_threads(args.threads)

    from icml26.core.io import atomic_write_json

    results = []
    for size_name in args.sizes:
        print(f"benchmarking {size_name} ...", flush=True)
        results.append(measure(size_name, arms, args.rounds, args.num_streams))
    # The load average says how contended the machine was: on a shared machine it inflates every arm.
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    atomic_write_json(args.out, {"benchmark": "kromhc_step", "platform": platform.platform(),
                                 "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                                 "num_streams": args.num_streams, "rounds": args.rounds, "target_ratio": TARGET,
                                 "load_average_after": load, "sizes": results})
    for res in results:
        for r in res["rows"]:
            flag = "" if r["arm"] == "residual" else ("  meets target" if r["ratio_to_residual_median"] <= TARGET
                                                      else "  above target")
            print(f"{r['size']:6s} {r['arm']:9s} {r['n_params']:>9,d} params  step {r['cpu_ms_median']:8.1f} ms CPU "
                  f"(min {r['cpu_ms_min']:7.1f})  x{r['ratio_to_residual_median']:.2f} of residual{flag}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
