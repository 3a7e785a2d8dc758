"""Training-step time of a TinyLM with KromHC (n = 4) against the plain residual and mHC (and optionally HC, mHC-lite).

One training step = forward, backward, gradient clipping and an AdamW step on a fixed batch. All models live in one
process and are timed in interleaved rounds (for each thread count in turn: residual, kromhc, mhc, ...), so a change
in machine load hits every arm and thread count alike; the ratio to the plain residual is taken within each round
(same thread count) and its median is reported. Target (issue 15): KromHC at most 1.2x the plain residual at
d = 128. ``--bandwidth`` adds the memory-bandwidth bound: a copy benchmark (GB/s, in cache and out of it) and the
bytes the n-stream residual must move per step at the least. Writes one JSON file atomically, with the machine.

    python benchmarks/kromhc_step.py --sizes quick full --threads 1 2 --rounds 12 --bandwidth \
        --out results/benchmarks/kromhc_step.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

BENCH = {"room": "kromhc", "args": ["--sizes", "full", "--arms", "residual", "kromhc", "mhc_lite", "hc", "--rounds",
                                   "5"],
         "threads_arg": "--threads", "seconds": 30,
         "ratios": {"KromHC / residual step, d = 128": "sizes[size=full].rows[arm=kromhc].ratio_to_residual_median",
                    "mHC-lite / residual step, d = 128":
                        "sizes[size=full].rows[arm=mhc_lite].ratio_to_residual_median",
                    "HC / residual step, d = 128": "sizes[size=full].rows[arm=hc].ratio_to_residual_median"}}

SIZES = {
    # The claim's quick tier and full tier models (experiments.py) and a wider one to show the trend with width.
    "quick": {"d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 64, "batch_size": 8},
    "full": {"d_model": 128, "n_layers": 6, "n_heads": 4, "seq_len": 256, "batch_size": 8},
    "wide": {"d_model": 256, "n_layers": 6, "n_heads": 4, "seq_len": 256, "batch_size": 8},
    "xwide": {"d_model": 512, "n_layers": 6, "n_heads": 8, "seq_len": 256, "batch_size": 8},
}
TARGET = 1.2


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


def measure(size_name: str, arms: list[str], rounds: int, num_streams: int, threads: list[int]) -> list[dict]:
    """One result per thread count; all arms and thread counts interleaved in each round."""
    size = SIZES[size_name]
    steps, params = {}, {}
    for arm in arms:
        steps[arm], params[arm] = build_step(arm, size, num_streams)
        for t in threads:
            torch.set_num_threads(t)
            steps[arm]()  # warm-up: first-call allocations and dispatch, at each thread count
    cpu = {(t, arm): [] for t in threads for arm in arms}
    wall = {(t, arm): [] for t in threads for arm in arms}
    for _ in range(rounds):
        for t in threads:
            torch.set_num_threads(t)
            for arm in arms:
                c0, w0 = time.process_time(), time.perf_counter()
                steps[arm]()
                cpu[t, arm].append(time.process_time() - c0)
                wall[t, arm].append(time.perf_counter() - w0)
    results = []
    for t in threads:
        rows = []
        for arm in arms:
            c, w = cpu[t, arm], wall[t, arm]
            ratios = [a / b for a, b in zip(c, cpu[t, "residual"])]
            wall_ratios = [a / b for a, b in zip(w, wall[t, "residual"])]
            rows.append({
                "size": size_name, "arm": arm, "threads": t, "n_params": params[arm],
                "cpu_ms_median": 1e3 * statistics.median(c), "cpu_ms_min": 1e3 * min(c),
                "wall_ms_median": 1e3 * statistics.median(w),
                "ratio_to_residual_median": statistics.median(ratios),
                "wall_ratio_to_residual_median": statistics.median(wall_ratios),
                "ratio_to_residual_of_min": min(c) / min(cpu[t, "residual"]),
                "cpu_ms_all": [1e3 * x for x in c], "wall_ms_all": [1e3 * x for x in w]})
        results.append({"size": size_name, "threads": t, **size, "rows": rows})
    return results


def copy_bandwidth(nbytes: int, repeats: int = 20) -> float:
    """Median GB/s of ``dst.copy_(src)`` on preallocated float32 buffers (a copy reads and writes nbytes each)."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def traffic_bound(size: dict, num_streams: int, bandwidth_gbs: float) -> dict:
    """The least bytes the n-stream residual moves per training step beyond the plain residual, and their time.

    Per wrapped sub-layer the widened stream X (N, n, D), N = batch x time tokens, must at the least be read once
    in the forward (norm, projection and mix can share one read) and the new stream written once; the backward
    reads the incoming gradient and X (for the mixing weights' gradients) and writes dX. That is 5 passes of
    N n D float32 values, against the plain residual's add (2 reads, 1 write of N D values in the forward; its
    backward passes the gradient through). Time at the measured bandwidth is the floor no implementation beats.
    """
    tokens = size["batch_size"] * size["seq_len"]
    stream_bytes = 4 * tokens * num_streams * size["d_model"]
    plain_bytes = 3 * 4 * tokens * size["d_model"]
    sublayers = 2 * size["n_layers"]
    extra = sublayers * (5 * stream_bytes - plain_bytes)
    return {"stream_bytes": stream_bytes, "sublayers": sublayers, "min_extra_bytes_per_step": extra,
            "min_extra_ms_per_step_at_bandwidth": 1e3 * extra / (bandwidth_gbs * 1e9)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["quick", "full"], choices=sorted(SIZES))
    parser.add_argument("--arms", nargs="+", default=["residual", "kromhc", "mhc"],
                        choices=["residual", "hc", "mhc", "mhc_lite", "kromhc"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--num-streams", type=int, default=4)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2],
                        help="torch thread counts, interleaved in every round (default 1 2)")
    parser.add_argument("--bandwidth", action="store_true",
                        help="also measure copy bandwidth and the least bytes the n-stream residual moves per step")
    parser.add_argument("--out", default="results/benchmarks/kromhc_step.json")
    args = parser.parse_args()
    if any(t < 1 for t in args.threads) or args.rounds < 1:
        raise ValueError(f"--threads and --rounds must be positive, got {args.threads} and {args.rounds}")
    arms = ["residual", *[a for a in args.arms if a != "residual"]]

    from icml26.harness.bench import machine_info, write_bench_json

    machine = machine_info(max(args.threads))
    results = []
    for size_name in args.sizes:
        print(f"benchmarking {size_name} at {args.threads} thread(s) ...", flush=True)
        results.extend(measure(size_name, arms, args.rounds, args.num_streams, args.threads))
    bandwidth = None
    if args.bandwidth:
        torch.set_num_threads(1)
        bandwidth = {"copy_gbs_4mib": copy_bandwidth(4 * 2**20), "copy_gbs_256mib": copy_bandwidth(256 * 2**20, 5)}
        bandwidth["bound"] = {name: traffic_bound(SIZES[name], args.num_streams, bandwidth["copy_gbs_256mib"])
                              for name in args.sizes}
        print(f"copy bandwidth (1 thread): {bandwidth['copy_gbs_4mib']:.1f} GB/s at 4 MiB, "
              f"{bandwidth['copy_gbs_256mib']:.1f} GB/s at 256 MiB", flush=True)
    write_bench_json(args.out, {"benchmark": "kromhc_step", "torch_threads": args.threads,
                                "num_streams": args.num_streams, "rounds": args.rounds, "target_ratio": TARGET,
                                "sizes": results, "bandwidth": bandwidth}, machine)
    for res in results:
        for r in res["rows"]:
            flag = "" if r["arm"] == "residual" else ("  meets target" if r["ratio_to_residual_median"] <= TARGET
                                                      else "  above target")
            print(f"{r['size']:6s} t={r['threads']} {r['arm']:9s} {r['n_params']:>9,d} params  step "
                  f"{r['cpu_ms_median']:8.1f} ms CPU ({r['wall_ms_median']:7.1f} wall)  "
                  f"x{r['ratio_to_residual_median']:.2f} of residual (wall x{r['wall_ratio_to_residual_median']:.2f})"
                  f"{flag}")
        if bandwidth:
            b = bandwidth["bound"][res["size"]]
            print(f"{res['size']:6s} least extra traffic {b['min_extra_bytes_per_step'] / 2**20:.0f} MiB/step = "
                  f"{b['min_extra_ms_per_step_at_bandwidth']:.1f} ms at the copy bandwidth")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
