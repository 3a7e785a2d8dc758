"""Speed and memory of FiX and FoX attention against torch's fused causal ``scaled_dot_product_attention``.

Three parts, repeated for every thread count in ``--threads`` (default 1 and 2):

* timing: forward + backward of the attention op alone (no projections) on (1, H, T, Dh) float32 inputs, for
  each T in ``--lengths``: SDPA, FoX and FiX in one process, interleaved over rounds; median wall time and the
  median of the per-round ratios to SDPA.
* memory: the same step once per kernel, each in its own process so that ``ru_maxrss`` is that case's true peak:
  peak RSS above the inputs (this includes what the allocator keeps after frees).
* decode: one attention layer per kind (d_model = H * Dh) with a prefilled cache of P tokens, then single-token
  steps, the three layers interleaved step by step in one process: tokens per second, the median of the per-step
  ratios to softmax, and cache bytes per token (softmax+RoPE = TinyLM's CausalSelfAttention, FoX, FiX).

Writes one JSON file atomically, with the machine (CPU, cores, threads, torch, BLAS, commit, load at start and
end; ``icml26.harness.bench``). Ratios from interleaved arms are what counts on a loaded machine.

    python benchmarks/fix_attention_speed.py --threads 1 2 --out results/benchmarks/fix_attention_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

KERNELS = ("sdpa", "fox", "fix")
LAYERS = ("softmax", "fox", "fix")

BENCH = {"room": "fix_attention", "args": ["--rounds", "3", "--decode-steps", "16"], "threads_arg": "--threads",
         "seconds": 110,
         "ratios": {"FiX / SDPA fwd+bwd, T = 1024": "runs[0].rows[part=timing,T=1024].ratio_to_sdpa_median.fix",
                    "FiX / SDPA fwd+bwd, T = 4096": "runs[0].rows[part=timing,T=4096].ratio_to_sdpa_median.fix",
                    "FoX / SDPA fwd+bwd, T = 1024": "runs[0].rows[part=timing,T=1024].ratio_to_sdpa_median.fox",
                    "FiX / SDPA peak memory, T = 1024": "runs[0].memory_ratio_to_sdpa[T=1024].fix",
                    "FiX / SDPA peak memory, T = 4096": "runs[0].memory_ratio_to_sdpa[T=4096].fix",
                    "FiX / softmax decode tokens/s, P = 1024":
                        "runs[0].rows[part=decode,prefix=1024].tokens_per_s_ratio.fix",
                    "FiX / softmax decode tokens/s, P = 4096":
                        "runs[0].rows[part=decode,prefix=4096].tokens_per_s_ratio.fix"}}


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


def decode_worker(prefix: int, heads: int, head_dim: int, steps: int, threads: int) -> dict:
    """The three layers in one process, their decode steps interleaved (softmax, fox, fix, softmax, ...)."""
    import torch

    from icml26.methods.fix_attention import attention_factory
    from icml26.models.tiny_lm import TinyLMConfig

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    d = heads * head_dim
    tiny = TinyLMConfig(d_model=d, n_layers=1, n_heads=heads, max_seq_len=prefix + steps + 1)
    # A lone layer has no token ids: FiX's layer-0 gates read the hidden state instead.
    layers = {kind: attention_factory(attention=kind, **({"gate_layer0_source": "hidden"} if kind == "fix" else {}))(
        tiny, 0).eval() for kind in LAYERS}
    x = torch.randn(1, prefix + steps, d)
    caches: dict[str, dict] = {kind: {} for kind in LAYERS}
    times: dict[str, list[float]] = {kind: [] for kind in LAYERS}
    with torch.no_grad():
        for kind, layer in layers.items():
            layer(x[:, :prefix], cache=caches[kind])
        for i in range(prefix, prefix + steps):
            for kind, layer in layers.items():
                start = time.perf_counter()
                layer(x[:, i:i + 1], cache=caches[kind])
                times[kind].append(time.perf_counter() - start)
    n_tokens = prefix + steps
    cache_bytes = {kind: sum(v.numel() * v.element_size() for v in caches[kind].values()) / n_tokens
                   for kind in LAYERS}
    return {"part": "decode", "prefix": prefix, "heads": heads, "head_dim": head_dim, "steps": steps,
            "step_s_median": {kind: statistics.median(times[kind]) for kind in LAYERS},
            "tokens_per_s": {kind: 1.0 / statistics.median(times[kind]) for kind in LAYERS},
            "tokens_per_s_ratio": {kind: statistics.median(s / k for k, s in zip(times[kind], times["softmax"]))
                                   for kind in LAYERS},
            "cache_bytes_per_token": cache_bytes,
            "cache_ratio_to_softmax": {kind: cache_bytes[kind] / cache_bytes["softmax"] for kind in LAYERS},
            "cache_keys": {kind: sorted(caches[kind]) for kind in LAYERS}}


def _run(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env={**os.environ})
    if out.returncode != 0:
        raise SystemExit(f"{args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure(args: argparse.Namespace, threads: int, done: dict, save) -> dict:
    """Every part at one thread count; each worker in its own process. ``done`` holds rows finished by an earlier,
    interrupted run with the same settings (resumed, not re-measured); ``save`` checkpoints after each worker."""
    common = ["--heads", str(args.heads), "--head-dim", str(args.head_dim), "--rounds", str(args.rounds),
              "--decode-steps", str(args.decode_steps), "--threads", str(threads)]
    jobs = [("timing", "all", t) for t in args.lengths]
    jobs += [("memory", kind, t) for t in args.lengths for kind in KERNELS]
    jobs += [("decode", "all", p) for p in args.decode_prefix]
    rows = []
    for part, kind, size in jobs:
        key = f"{threads}:{part}:{kind}:{size}"
        if key not in done:
            print(f"[{threads} thread(s)] {part} {kind} {size} ...", file=sys.stderr, flush=True)
            done[key] = _run(["--worker", part, kind, str(size), *common])
            save()
        rows.append(done[key])
    memory = []
    for t in args.lengths:
        peak = {r["kind"]: r["peak_rss_over_inputs_mib"] for r in rows if r["part"] == "memory" and r["T"] == t}
        memory.append({"T": t, **{kind: peak[kind] / peak["sdpa"] for kind in KERNELS}})
    return {"threads": threads, "rows": rows, "memory_ratio_to_sdpa": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per length")
    parser.add_argument("--decode-prefix", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="results/benchmarks/fix_attention_speed.json")
    parser.add_argument("--worker", nargs=3, metavar=("PART", "KIND", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if any(n < 1 for n in args.threads) or args.rounds < 1 or args.decode_steps < 1:
        parser.error("--threads, --rounds and --decode-steps must be positive")
    if args.worker:
        part, kind, size = args.worker
        threads = args.threads[0]
        if part == "timing":
            row = timing_worker(int(size), args.heads, args.head_dim, args.rounds, threads)
        elif part == "memory":
            row = memory_worker(kind, int(size), args.heads, args.head_dim, threads)
        else:
            row = decode_worker(int(size), args.heads, args.head_dim, args.decode_steps, threads)
        print(json.dumps(row))
        return

    from icml26.harness.bench import machine_info, write_bench_json

    from icml26.core.io import atomic_write_json, read_json

    machine = machine_info(args.threads[0] if len(args.threads) == 1 else None)
    machine["torch_threads"] = args.threads
    partial = f"{args.out}.partial"
    settings = {k: getattr(args, k) for k in ("lengths", "heads", "head_dim", "rounds", "decode_prefix",
                                              "decode_steps")}
    done: dict = {}
    if os.path.exists(partial):
        saved = read_json(partial)
        if saved.get("settings") == settings:
            done = saved["rows"]
            print(f"resuming {len(done)} finished worker(s) from {partial}", file=sys.stderr)
    save = lambda: atomic_write_json(partial, {"settings": settings, "rows": done})  # noqa: E731
    runs = [_measure(args, threads, done, save) for threads in args.threads]
    write_bench_json(args.out, {"benchmark": "fix_attention_speed", "heads": args.heads, "head_dim": args.head_dim,
                                "runs": runs}, machine)
    for run in runs:
        print(f"--- {run['threads']} thread(s)")
        for r in run["rows"]:
            if r["part"] == "timing":
                for kind in KERNELS:
                    print(f"kernel {kind:5s} T={r['T']:5d}  fwd+bwd {r['fwd_bwd_s_median'][kind] * 1e3:8.1f} ms "
                          f"(x{r['ratio_to_sdpa_median'][kind]:.2f} SDPA, median of {r['rounds']} interleaved rounds)")
            elif r["part"] == "memory":
                print(f"memory {r['kind']:5s} T={r['T']:5d}  peak +{r['peak_rss_over_inputs_mib']:.1f} MiB over inputs")
            else:
                for kind in LAYERS:
                    print(f"decode {kind:7s} P={r['prefix']:5d}  {r['tokens_per_s'][kind]:8.1f} tok/s "
                          f"(x{r['tokens_per_s_ratio'][kind]:.2f} softmax, interleaved)  cache "
                          f"{r['cache_bytes_per_token'][kind]:.0f} B/token (x{r['cache_ratio_to_softmax'][kind]:.3f})")
        for m in run["memory_ratio_to_sdpa"]:
            print(f"memory / SDPA T={m['T']:5d}  fox x{m['fox']:.2f}  fix x{m['fix']:.2f}")
    if os.path.exists(partial):
        os.remove(partial)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
