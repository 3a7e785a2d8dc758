"""TabICLv2 ablations as short classification pretrains (protocol pre-registered in
src/icml26/methods/tabicl2/README.md, "Ablations"):

1. query scaling in the in-context blocks and ISAB step A: QASSMax vs SSMax vs plain softmax, evaluated with a test
   context (1,024 training rows) 8x longer than the longest pretraining context (128 rows);
2. Muon vs AdamW at equal wall time (QASSMax both).

Every run pretrains for the same wall-clock schedule (``--minutes``) from the same seed and data stream; runs are
sequential and resumable (each pretrain resumes from its own ``state.pt``; the JSON is rewritten atomically after
every run and every evaluation). Rerun the same command after a kill.

    python benchmarks/tabicl2_ablations.py --minutes 8 --out results/benchmarks/tabicl2_ablations.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

RUNS = {  # name -> (TabICLConfig overrides, optimizer)
    "qassmax_muon": ({"ssmax": "qassmax"}, "muon"),
    "qassmax_adamw": ({"ssmax": "qassmax"}, "adamw"),  # next to its Muon twin: similar machine load
    "ssmax_muon": ({"ssmax": "ssmax"}, "muon"),
    "softmax_muon": ({"ssmax": "none"}, "muon"),
}
CONTEXTS = (96, 1024)


def eval_set(n_train: int, n_test: int = 128, n_features: int = 8, batches: int = 4, seed: int = 7 * 10 ** 6) -> list:
    """Held-out prior batches of 16 datasets with ``n_train`` context rows (never seen in pretraining: the
    pretraining seeds are ``seed * 1e9 + step * 1000 + rank`` with seed 0)."""
    import torch
    from icml26.methods.tabicl2.prior import sample_batch
    out = []
    for b in range(batches):
        X, y = sample_batch(seed + b, 16, n_train + n_test, n_features, n_train)
        out.append((torch.from_numpy(X), torch.from_numpy(y), n_train))
    return out


def main(argv=None) -> dict:
    import torch
    from icml26.core.io import atomic_write_json
    from icml26.methods.tabicl2 import pretrain
    from icml26.methods.tabicl2.estimator import load_model
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--runs", nargs="*", default=list(RUNS))
    p.add_argument("--dir", default="results/tabicl2/ablations")
    p.add_argument("--out", default="results/benchmarks/tabicl2_ablations.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    state = json.loads(out.read_text()) if out.exists() else {"runs": {}}
    state.update({"benchmark": "tabicl2 ablations", "minutes": args.minutes, "contexts": list(CONTEXTS),
                  "note": "one pretraining seed per arm; shared 2-core machine (wall-clock schedules)"})
    for name in args.runs:
        overrides, optimizer = RUNS[name]
        run_dir, ck = Path(args.dir) / name, Path(args.dir) / name / "model.pt"
        if name not in state["runs"]:
            result = pretrain.main(["--out", str(run_dir), "--minutes", str(args.minutes), "--min-rows", "32",
                                    "--max-rows", "128", "--max-features", "8", "--batch", "16", "--lr", "2e-3",
                                    "--optimizer", optimizer, "--eval-every", "100", "--val-batches", "2",
                                    "--model", json.dumps(overrides), "--export", str(ck)])
            state["runs"][name] = {"pretrain": result}
            atomic_write_json(out, state)
        if "eval" not in state["runs"][name]:
            model = load_model(ck)
            ev = {}
            for ctx in CONTEXTS:
                ev[str(ctx)] = pretrain.evaluate(model, eval_set(ctx), torch.device("cpu"))
            ev["ce_rise"] = ev[str(CONTEXTS[1])]["val_ce"] - ev[str(CONTEXTS[0])]["val_ce"]
            # spread of the held-out CE over the run's last two evaluations (the pre-registered noise yardstick)
            log = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines() if "val_ce" in x]
            ev["last_eval_spread"] = abs(log[-1]["val_ce"] - log[-2]["val_ce"]) if len(log) >= 2 else None
            state["runs"][name]["eval"] = ev
            atomic_write_json(out, state)
            print(name, json.dumps(ev), flush=True)
    return state


if __name__ == "__main__":
    main()
