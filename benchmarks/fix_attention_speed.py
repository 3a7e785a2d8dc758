"""Speed and memory of FiX and FoX attention against torch's fused causal ``scaled_dot_product_attention``.

Three parts:

* timing: forward + backward of the attention op alone (no projections) on (B, H, T, Dh) float32 inputs, for
  T in {256, 1024, 4096}: SDPA, FoX and FiX in one process, interleaved over rounds; median wall time and the median
  of the per-round ratios to SDPA.
* memory: the same step once per kernel, each in its own subprocess so that ``ru_maxrss`` is that case's true peak:
  peak RSS above the inputs.
* decode: one attention layer (d_model = H * Dh) with a prefilled cache of P tokens, then single-token steps:
  tokens per second, and cache bytes per token (softmax+RoPE = TinyLM's CausalSelfAttention, FoX, FiX).

Writes one JSON file atomically. Threads default to 1: on a shared 2-core machine one intra-op thread per process
gives the steadiest numbers; pass ``--threads 2`` on an idle machine.

    python benchmarks/fix_attention_speed.py --out results/benchmarks/fix_attention_speed.json
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

KERNELS = ("sdpa", "fox", "fix")
LAYERS = ("softmax", "fox", "fix")


def _kernel_case(kind: str, t: int, heads: int, head_dim: int):
    """A closure running forward + backward of one attention kernel on fixed (1, H, T, Dh) float32 inputs."""
    import torch
    import torch.nn.functional as F

    from icml26.methods.fix_attention import fix_attention_chunked, fox_attention_chunked

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, t, head_dim, generator=gen, requires_grad=True) for _ in range(3))
    # Gates near 1 with a spread (typical after training): logsigmoid of N(4, 1) logits.
    logits = torch.randn(1, heads, t, head_dim, generator=gen) + 4.0
    log_f = F.logsigmoid(logits if kind == "fix" else logits[..., 0]).requires_grad_()
    grad = torch.randn(1, heads, t, head_dim, generator=gen)

    def step() -> None:
        for x in (q, k, v, log_f):
            x.grad = None
        if kind == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif kind == "fox":
            out = fox_attention_chunked(q, k, v, log_f)
        else:
            out = fix_attention_chunked(q, k, v, log_f)
        out.backward(grad)

    return step


def timing_worker(t: int, heads: int, head_dim: int, rounds: int, threads: int) -> dict:
    """All kernels in one process, timed in interleaved rounds (sdpa, fox, fix, sdpa, ...) so that a change in
    machine load hits every kernel alike; the ratio to SDPA is taken within each round."""
    import torch

    torch.set_num_threads(threads)
    steps = {kind: _kernel_case(kind, t, heads, head_dim) for kind in KERNELS}
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {kind: [] for kind in KERNELS}
    for _ in range(rounds):
        for kind, step in steps.items():
            start = time.perf_counter()
            step()
            times[kind].append(time.perf_counter() - start)
    ratios = {kind: statistics.median(a / b for a, b in zip(times[kind], times["sdpa"])) for kind in KERNELS}
    return {"part": "timing", "T": t, "heads": heads, "head_dim": head_dim, "rounds": rounds,
            "fwd_bwd_s_median": {kind: statistics.median(v) for kind, v in times.items()},
            "ratio_to_sdpa_median": ratios, "fwd_bwd_s_all": times}


def memory_worker(kind: str, t: int, heads: int, head_dim: int, threads: int) -> dict:
    """Peak RSS of one forward + backward above the inputs, in a process of its own (ru_maxrss is per process)."""
    import torch

    from icml26.core.memory import current_rss_bytes

    torch.set_num_threads(threads)
    # Warm up on a short sequence so one-time library allocations stay below the measured baseline.
    _kernel_case(kind, 64, heads, head_dim)()
    step = _kernel_case(kind, t, heads, head_dim)
    base = current_rss_bytes()
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"part": "memory", "kind": kind, "T": t, "heads": heads, "head_dim": head_dim,
            "peak_rss_over_inputs_mib": (peak - base) / 2**20}


def decode_worker(kind: str, prefix: int, heads: int, head_dim: int, steps: int, threads: int) -> dict:
    import torch

    from icml26.methods.fix_attention import attention_factory
    from icml26.models.tiny_lm import TinyLMConfig

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    d = heads * head_dim
    tiny = TinyLMConfig(d_model=d, n_layers=1, n_heads=heads, max_seq_len=prefix + steps + 1)
    layer = attention_factory(attention=kind)(tiny, 0).eval()
    x = torch.randn(1, prefix + steps, d)
    cache: dict = {}
    with torch.no_grad():
        layer(x[:, :prefix], cache=cache)
        times = []
        for i in range(prefix, prefix + steps):
            start = time.perf_counter()
            layer(x[:, i:i + 1], cache=cache)
            times.append(time.perf_counter() - start)
    n_tokens = prefix + steps
    cache_bytes = sum(v.numel() * v.element_size() for v in cache.values())
    return {"part": "decode", "kind": kind, "prefix": prefix, "heads": heads, "head_dim": head_dim,
            "step_s_median": statistics.median(times), "tokens_per_s": 1.0 / statistics.median(times),
            "cache_bytes_per_token": cache_bytes / n_tokens, "cache_keys": sorted(cache)}


def _run(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env={**os.environ})
    if out.returncode != 0:
        raise SystemExit(f"{args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds per length")
    parser.add_argument("--decode-prefix", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/benchmarks/fix_attention_speed.json")
    parser.add_argument("--worker", nargs=3, metavar=("PART", "KIND", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        part, kind, size = args.worker
        if part == "timing":
            row = timing_worker(int(size), args.heads, args.head_dim, args.rounds, args.threads)
        elif part == "memory":
            row = memory_worker(kind, int(size), args.heads, args.head_dim, args.threads)
        else:
            row = decode_worker(kind, int(size), args.heads, args.head_dim, args.decode_steps, args.threads)
        print(json.dumps(row))
        return

    from icml26.core.io import atomic_write_json

    common = ["--heads", str(args.heads), "--head-dim", str(args.head_dim), "--rounds", str(args.rounds),
              "--decode-steps", str(args.decode_steps), "--threads", str(args.threads)]
    rows = []
    for t in args.lengths:
        print(f"timing T={t} ...", file=sys.stderr, flush=True)
        rows.append(_run(["--worker", "timing", "all", str(t), *common]))
        for kind in KERNELS:
            print(f"memory {kind} T={t} ...", file=sys.stderr, flush=True)
            rows.append(_run(["--worker", "memory", kind, str(t), *common]))
    for prefix in args.decode_prefix:
        for kind in LAYERS:
            print(f"decode {kind} P={prefix} ...", file=sys.stderr, flush=True)
            rows.append(_run(["--worker", "decode", kind, str(prefix), *common]))
    for row in rows:
        if row["part"] == "decode":
            ref = next(r for r in rows if r["part"] == "decode" and r["prefix"] == row["prefix"]
                       and r["kind"] == "softmax")
            row["cache_ratio_to_softmax"] = row["cache_bytes_per_token"] / ref["cache_bytes_per_token"]
    import torch

    atomic_write_json(args.out, {"benchmark": "fix_attention_speed", "platform": platform.platform(),
                                 "torch": torch.__version__, "threads": args.threads, "heads": args.heads,
                                 "head_dim": args.head_dim, "rows": rows})
    for r in rows:
        if r["part"] == "timing":
            for kind in KERNELS:
                print(f"kernel {kind:5s} T={r['T']:5d}  fwd+bwd {r['fwd_bwd_s_median'][kind] * 1e3:8.1f} ms "
                      f"(x{r['ratio_to_sdpa_median'][kind]:.2f} SDPA, median of {r['rounds']} interleaved rounds)")
        elif r["part"] == "memory":
            print(f"memory {r['kind']:5s} T={r['T']:5d}  peak +{r['peak_rss_over_inputs_mib']:.0f} MiB over inputs")
        else:
            print(f"decode {r['kind']:7s} P={r['prefix']:5d}  {r['tokens_per_s']:8.1f} tok/s  "
                  f"cache {r['cache_bytes_per_token']:.0f} B/token (x{r['cache_ratio_to_softmax']:.3f} softmax)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
