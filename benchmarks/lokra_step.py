"""Step time and peak memory of LoRA, LoKRA and LoKRA+ (backprop + AdamW) on the tiny LM and on SmolLM2-135M.

Every arm has LoRA-r's trainable budget. Each (model, arm) pair runs in its own subprocess so that ``ru_maxrss`` is
that pair's own peak. Writes one JSON file (atomically) with per-pair medians and ratios to LoRA from the same run;
the target is LoKRA <= 1.3x LoRA per step.

    python benchmarks/lokra_step.py --models tiny smollm2 --steps 5 --out results/benchmarks/lokra_step.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time

ARMS = ("lora", "lokra", "lokra_soft_max", "lokra_plus")
TARGET_RATIO = 1.3

BENCH = {"room": "lokra", "args": ["--models", "tiny", "--arms", "lora", "lokra", "--steps", "5"],
         "seconds": 25,
         "ratios": {"LoKRA / LoRA step, tiny LM (separate processes)": "rows[arm=lokra].step_time_ratio_to_lora",
                    "LoKRA with / without penalty, paired": "rows[arm=lokra].paired_ratio_with_over_without_penalty"}}


def worker(model_name: str, arm: str, steps: int) -> dict:
    import torch

    from icml26.core.adapters import AdapterConfig, LoRALinear, count_trainable_parameters, inject_adapters
    from icml26.core.memory import current_rss_bytes
    from icml26.methods.lokra import LoKRAConfig, kruskal_penalty, lokra_make, lokra_plus_make

    torch.manual_seed(0)
    if model_name == "tiny":
        from icml26.models.tiny_lm import TinyLM, TinyLMConfig

        model = TinyLM(TinyLMConfig(d_model=128, n_layers=4, n_heads=4, max_seq_len=256))
        ids = torch.randint(0, 256, (8, 257))
        adapters = AdapterConfig(r=16, alpha=32.0, target_modules=["qkv_proj", "out_proj"])
        loss_fn = lambda: model(ids[:, :-1], ids[:, 1:])[1]  # noqa: E731
    else:
        from icml26.models.smollm2 import load_smollm2

        model, _ = load_smollm2()
        ids = torch.randint(0, model.config.vocab_size, (4, 64))
        # r=24: the smallest rank at which LoKRA+ fits LoRA's budget on the 576-wide projections.
        adapters = AdapterConfig(r=24, alpha=48.0, target_modules=["q_proj", "v_proj"])
        loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    make = {"lora": lambda linear, r, alpha, name: LoRALinear(linear, r, alpha),
            "lokra": lokra_make(LoKRAConfig()),
            "lokra_soft_max": lokra_make(LoKRAConfig(coherence="soft_max")),
            "lokra_plus": lokra_plus_make(LoKRAConfig())}[arm]
    n_layers = len(inject_adapters(model, adapters, make))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    penalised = arm != "lora"
    base_rss = current_rss_bytes()

    def step(with_penalty: bool = penalised) -> None:
        loss = loss_fn()
        if with_penalty:
            loss = loss + kruskal_penalty(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    penalty_times = []
    if penalised:
        for _ in range(steps):
            start = time.perf_counter()
            kruskal_penalty(model).backward()
            penalty_times.append(time.perf_counter() - start)
    # LoKRA's layer is LoRA's, so alternating steps with and without the penalty on the same model measures the
    # penalty's overhead with the machine's load drift cancelled (the separate-process ratio is noisier).
    # The order within a pair alternates, since the second step of a pair tends to run a little faster.
    paired = []
    if arm == "lokra":
        for i in range(2 * steps):
            first = bool(i % 2)
            start = time.perf_counter()
            step(with_penalty=first)
            middle = time.perf_counter()
            step(with_penalty=not first)
            end = time.perf_counter()
            with_s, without_s = (middle - start, end - middle) if first else (end - middle, middle - start)
            paired.append(with_s / without_s)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"model": model_name, "arm": arm, "adapted_layers": n_layers, "rank": adapters.r,
            "n_trainable": count_trainable_parameters(model), "step_s_median": statistics.median(times),
            "step_s_all": times, "penalty_fwd_bwd_s_median": statistics.median(penalty_times) if penalty_times else 0.0,
            "paired_ratio_with_over_without_penalty": statistics.median(paired) if paired else None,
            "peak_rss_bytes": peak, "rss_after_setup_bytes": base_rss, "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="results/benchmarks/lokra_step.json")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "ARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps)))
        return
    if "lora" not in args.arms:
        raise SystemExit("--arms must include lora, the reference every ratio is taken against")

    from icml26.core.io import atomic_write_json
    from icml26.core.memory import run_isolated

    rows = []
    for model_name in args.models:
        for arm in args.arms:
            print(f"benchmarking {model_name} / {arm} ...", file=sys.stderr, flush=True)
            rows.append(run_isolated(__file__, "--worker", model_name, arm, "--steps", str(args.steps)))
    for row in rows:
        ref = next(r for r in rows if r["model"] == row["model"] and r["arm"] == "lora")
        row["step_time_ratio_to_lora"] = row["step_s_median"] / ref["step_s_median"]
        row["peak_rss_ratio_to_lora"] = row["peak_rss_bytes"] / ref["peak_rss_bytes"]
        row["extra_peak_over_setup_mib"] = (row["peak_rss_bytes"] - row["rss_after_setup_bytes"]) / 2**20
    lokra = [r for r in rows if r["arm"] == "lokra"]
    atomic_write_json(args.out, {"benchmark": "lokra_step", "platform": platform.platform(), "steps": args.steps,
                                 "target": f"LoKRA step time <= {TARGET_RATIO}x LoRA",
                                 "target_met_separate_processes": all(r["step_time_ratio_to_lora"] <= TARGET_RATIO
                                                                      for r in lokra),
                                 "target_met_paired": all(r["paired_ratio_with_over_without_penalty"] <= TARGET_RATIO
                                                          for r in lokra),
                                 "rows": rows})
    for r in rows:
        print(f"{r['model']:8s} {r['arm']:15s} step {r['step_s_median'] * 1e3:8.1f} ms  "
              f"x{r['step_time_ratio_to_lora']:.2f} of LoRA  penalty {r['penalty_fwd_bwd_s_median'] * 1e3:6.1f} ms  "
              f"peak RSS {r['peak_rss_bytes'] / 2**20:7.0f} MiB (+{r['extra_peak_over_setup_mib']:.0f})  "
              f"trainable {r['n_trainable']}"
              + (f"  paired x{r['paired_ratio_with_over_without_penalty']:.3f}" if r["arm"] == "lokra" else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
