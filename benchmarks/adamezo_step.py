"""Step time and peak memory of MeZO, AdaMeZO and backprop Adam on the tiny LM and on SmolLM2-135M.

Each (model, optimizer) pair runs in its own subprocess so that ``ru_maxrss`` is that pair's true peak.
Writes one JSON file (atomically) with per-pair medians and ratios to MeZO measured in the same run.

    python benchmarks/adamezo_step.py --models tiny smollm2 --steps 10 --out results/benchmarks/adamezo_step.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time

ARMS = ("mezo", "adamezo", "adam")


def worker(model_name: str, arm: str, steps: int, window: int) -> dict:
    import torch

    from icml26.core.memory import current_rss_bytes, optimizer_state_bytes
    from icml26.methods.adamezo import AdaMeZO, MeZO

    torch.manual_seed(0)
    if model_name == "tiny":
        from icml26.models.tiny_lm import TinyLM, TinyLMConfig

        model = TinyLM(TinyLMConfig(d_model=128, n_layers=4, n_heads=4, max_seq_len=256))
        ids = torch.randint(0, 256, (8, 256))
        loss_fn = lambda: model(ids[:, :-1], ids[:, 1:])[1]  # noqa: E731
    else:
        from icml26.models.smollm2 import load_smollm2

        model, _ = load_smollm2()
        ids = torch.randint(0, model.config.vocab_size, (4, 64))
        loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    base_rss = current_rss_bytes()
    if arm == "adam":
        opt = torch.optim.Adam(params, lr=1e-5)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn().backward()
            opt.step()
    else:
        opt = MeZO(params, lr=1e-7) if arm == "mezo" else AdaMeZO(params, lr=1e-7, window=window)

        def step():
            opt.step(loss_fn)
    # Warm up past AdaMeZO's MeZO phase (window + 1 steps) so the timed steps are adaptive ones.
    for _ in range(window + 2 if arm == "adamezo" else 2):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"model": model_name, "arm": arm, "n_params": sum(p.numel() for p in params),
            "step_s_median": statistics.median(times), "step_s_all": times, "peak_rss_bytes": peak,
            "rss_after_model_bytes": base_rss, "optimizer_state_bytes": optimizer_state_bytes(opt)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--out", default="results/benchmarks/adamezo_step.json")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "ARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps, args.window)))
        return

    from icml26.core.io import atomic_write_json
    from icml26.core.memory import run_isolated

    rows = []
    for model_name in args.models:
        for arm in ARMS:
            print(f"benchmarking {model_name} / {arm} ...", file=sys.stderr, flush=True)
            rows.append(run_isolated(__file__, "--worker", model_name, arm, "--steps", str(args.steps),
                                     "--window", str(args.window)))
    for row in rows:
        ref = next(r for r in rows if r["model"] == row["model"] and r["arm"] == "mezo")
        row["step_time_ratio_to_mezo"] = row["step_s_median"] / ref["step_s_median"]
        row["peak_rss_ratio_to_mezo"] = row["peak_rss_bytes"] / ref["peak_rss_bytes"]
        row["extra_peak_over_model_mib"] = (row["peak_rss_bytes"] - row["rss_after_model_bytes"]) / 2**20
    atomic_write_json(args.out, {"benchmark": "adamezo_step", "platform": platform.platform(),
                                 "torch_threads": __import__("torch").get_num_threads(), "steps": args.steps,
                                 "window": args.window, "rows": rows})
    for r in rows:
        print(f"{r['model']:8s} {r['arm']:8s} step {r['step_s_median'] * 1e3:8.1f} ms  "
              f"x{r['step_time_ratio_to_mezo']:.2f} of MeZO   peak RSS {r['peak_rss_bytes'] / 2**20:7.0f} MiB "
              f"(+{r['extra_peak_over_model_mib']:.0f} over model)   state {r['optimizer_state_bytes']} B")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
