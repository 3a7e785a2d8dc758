"""Step time and peak memory of ScaLoRA (merge + optimal rescale every step) against plain LoRA and ReLoRA.

A step is forward + backward + optimizer step (+ ScaLoRA's merge-rescale). Two kinds of subprocess per model:

* timing: every arm's model lives in one process and the arms take their steps in turn (round-robin, order
  rotated each round), so that load from other processes on a shared machine hits every arm alike; the
  ratio to LoRA is the median of the per-round ratios. Both wall time and this process's CPU time are
  recorded: on a shared, loaded machine the CPU time (with ``--threads 1``) is the stable measure of the work
  a step does, while wall time also counts waiting for a core;
* memory: one process per arm, so that ``ru_maxrss`` is that arm's own peak.

Writes one JSON file (atomically). The target from the issue: ScaLoRA at most 1.3x LoRA per step.

    python benchmarks/scalora_step.py --models tiny smollm2 --steps 10 --out results/benchmarks/scalora_step.json
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

ARMS = ("lora", "scalora", "scalora_sgd_proxy", "relora")
TARGET_RATIO = 1.3

BENCH = {"room": "scalora", "args": ["--models", "tiny", "--steps", "10"], "threads_arg": "--threads",
         "seconds": 50,
         "ratios": {"ScaLoRA / LoRA step CPU, tiny LM": "rows[arm=scalora].step_cpu_ratio_to_lora",
                    "ScaLoRA / LoRA step wall, tiny LM": "rows[arm=scalora].step_time_ratio_to_lora"}}


def _build(model_name: str, arm: str, rank: int):
    """One model with the arm's adapters and optimizer; returns (step function, optimizer, inner, n_adapters)."""
    import torch

    from icml26.core.adapters import AdapterConfig, LoRALinear, inject_adapters
    from icml26.methods.scalora import ReLoRAOptimizer, ScaLoRALinear, ScaLoRAOptimizer

    torch.manual_seed(0)
    if model_name == "tiny":
        from icml26.models.tiny_lm import TinyLM, TinyLMConfig

        model = TinyLM(TinyLMConfig(d_model=128, n_layers=4, n_heads=4, max_seq_len=256))
        ids = torch.randint(0, 256, (8, 257))
        targets = ["qkv_proj", "out_proj", "gate_proj", "up_proj", "down_proj"]
        loss_fn = lambda: model(ids[:, :-1], ids[:, 1:])[1]  # noqa: E731
    else:
        from icml26.models.smollm2 import load_smollm2

        model, _ = load_smollm2()
        ids = torch.randint(0, model.config.vocab_size, (4, 128))
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    model.eval()
    layer = LoRALinear if arm in ("lora", "relora") else ScaLoRALinear
    names = inject_adapters(model, AdapterConfig(r=rank, alpha=2.0 * rank, target_modules=targets),
                            lambda linear, r, alpha, name: layer(linear, r, alpha))
    inner = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    if arm == "scalora":
        opt = ScaLoRAOptimizer(model, inner)
    elif arm == "scalora_sgd_proxy":
        opt = ScaLoRAOptimizer(model, inner, proxy="sgd")
    elif arm == "relora":
        opt = ReLoRAOptimizer(model, inner, every=100)
    else:
        opt = inner

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        opt.step()

    return step, opt, inner, len(names)


def time_worker(model_name: str, arms: list[str], steps: int, rank: int, threads: int) -> dict:
    """All arms in this process, stepping round-robin; per-arm step times and ScaLoRA's rescale times."""
    import torch

    from icml26.methods.scalora import ScaLoRAOptimizer

    torch.set_num_threads(threads)
    built = {arm: _build(model_name, arm, rank) for arm in arms}
    rescale: dict[str, list[float]] = {arm: [] for arm in arms}
    rescale_cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    for arm, (_, opt, _, _) in built.items():
        if isinstance(opt, ScaLoRAOptimizer):
            inner_rescale = opt.merge_rescale

            def timed(inner_rescale=inner_rescale, sink=rescale[arm], sink_cpu=rescale_cpu[arm]) -> None:
                start, start_cpu = time.perf_counter(), time.process_time()
                inner_rescale()
                sink.append(time.perf_counter() - start)
                sink_cpu.append(time.process_time() - start_cpu)

            opt.merge_rescale = timed
    for arm in arms:  # warm-up: first calls allocate and dispatch slowly
        for _ in range(2):
            built[arm][0]()
        rescale[arm].clear()
        rescale_cpu[arm].clear()
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    for i in range(steps):
        order = arms[i % len(arms):] + arms[:i % len(arms)]
        for arm in order:
            start, start_cpu = time.perf_counter(), time.process_time()
            built[arm][0]()
            times[arm].append(time.perf_counter() - start)
            cpu[arm].append(time.process_time() - start_cpu)
    return {"times": times, "cpu": cpu, "rescale": rescale, "rescale_cpu": rescale_cpu,
            "n_adapters": {a: b[3] for a, b in built.items()},
            "trainable_params": {a: sum(p.numel() for g in b[2].param_groups for p in g["params"])
                                 for a, b in built.items()}}


def memory_worker(model_name: str, arm: str, steps: int, rank: int, threads: int) -> dict:
    """One arm alone: peak RSS over a few steps, and the inner optimizer's state size."""
    import torch

    from icml26.core.memory import current_rss_bytes, optimizer_state_bytes

    torch.set_num_threads(threads)
    step, _, inner, _ = _build(model_name, arm, rank)
    base_rss = current_rss_bytes()
    for _ in range(steps):
        step()
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_after_model_bytes": base_rss, "optimizer_state_bytes": optimizer_state_bytes(inner)}


def _run(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode != 0:
        raise SystemExit(f"{args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/benchmarks/scalora_step.json")
    parser.add_argument("--time-worker", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--memory-worker", nargs=2, metavar=("MODEL", "ARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    common = (args.rank, args.threads)
    if args.time_worker:
        print(json.dumps(time_worker(args.time_worker, args.arms, args.steps, *common)))
        return
    if args.memory_worker:
        print(json.dumps(memory_worker(*args.memory_worker, args.memory_steps, *common)))
        return
    if "lora" not in args.arms:
        raise SystemExit("--arms must include lora: every ratio is to LoRA measured in the same run")

    from icml26.core.io import atomic_write_json

    flags = ["--rank", str(args.rank), "--threads", str(args.threads), "--steps", str(args.steps),
             "--memory-steps", str(args.memory_steps)]
    rows = []
    for model_name in args.models:
        print(f"timing {model_name}: {', '.join(args.arms)} round-robin ...", file=sys.stderr, flush=True)
        timing = _run(["--time-worker", model_name, "--arms", *args.arms, *flags])
        lora, lora_cpu = timing["times"]["lora"], timing["cpu"]["lora"]
        for arm in args.arms:
            print(f"memory {model_name} / {arm} ...", file=sys.stderr, flush=True)
            mem = _run(["--memory-worker", model_name, arm, *flags])
            own, own_cpu = timing["times"][arm], timing["cpu"][arm]
            rows.append({
                "model": model_name, "arm": arm, "n_adapters": timing["n_adapters"][arm],
                "trainable_params": timing["trainable_params"][arm], "step_s_median": statistics.median(own),
                "step_s_all": own, "step_cpu_s_median": statistics.median(own_cpu), "step_cpu_s_all": own_cpu,
                "rescale_s_median": statistics.median(timing["rescale"][arm] or [0.0]),
                "rescale_cpu_s_median": statistics.median(timing["rescale_cpu"][arm] or [0.0]),
                "step_time_ratio_to_lora": statistics.median(a / b for a, b in zip(own, lora)),
                "step_cpu_ratio_to_lora": statistics.median(a / b for a, b in zip(own_cpu, lora_cpu)), **mem,
                "extra_peak_over_model_mib": (mem["peak_rss_bytes"] - mem["rss_after_model_bytes"]) / 2**20})
    for row in rows:
        ref = next(r for r in rows if r["model"] == row["model"] and r["arm"] == "lora")
        row["peak_rss_ratio_to_lora"] = row["peak_rss_bytes"] / ref["peak_rss_bytes"]
        row["meets_target_cpu"] = row["arm"] != "scalora" or row["step_cpu_ratio_to_lora"] <= TARGET_RATIO
        row["meets_target_wall"] = row["arm"] != "scalora" or row["step_time_ratio_to_lora"] <= TARGET_RATIO
    atomic_write_json(args.out, {"benchmark": "scalora_step", "platform": platform.platform(),
                                 "torch_threads": args.threads, "steps": args.steps, "rank": args.rank,
                                 "target_ratio_scalora_over_lora": TARGET_RATIO, "rows": rows})
    for r in rows:
        print(f"{r['model']:8s} {r['arm']:18s} step {r['step_s_median'] * 1e3:8.1f} ms wall "
              f"x{r['step_time_ratio_to_lora']:.2f}, {r['step_cpu_s_median'] * 1e3:8.1f} ms CPU "
              f"x{r['step_cpu_ratio_to_lora']:.2f} of LoRA  (rescale {r['rescale_cpu_s_median'] * 1e3:6.1f} ms CPU)  "
              f"peak RSS {r['peak_rss_bytes'] / 2**20:7.0f} MiB (+{r['extra_peak_over_model_mib']:.0f} over model)  "
              f"x{r['peak_rss_ratio_to_lora']:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
