"""AdaMeZO's fast step (fused restore + update, piecewise replay into scratch, slot-parallel draws) changes no bit.

The oracle is ``PlainAdaMeZO`` below: the per-tensor implementation this replaced (commit be1c1ea), which draws
every z as a fresh whole tensor and accumulates m and v per tensor. ``optimizer.CHUNK`` is patched down to 64 so
that small odd-shaped tensors are cut into several pieces with a ragged last piece, as SmolLM2's embedding is.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from icml26.core.testing import assert_close
from icml26.methods.adamezo import AdaMeZO, MeZO, optimizer
from icml26.methods.adamezo.optimizer import perturbation_seed
from icml26.methods.adamezo.reference import ReferenceAdaMeZO

README = Path(__file__).resolve().parents[2] / "src" / "icml26" / "methods" / "adamezo" / "README.md"


def _normal(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.normal(0.0, 1.0, size=p.shape, generator=gen, dtype=p.dtype, device=p.device)


class PlainAdaMeZO:
    """The replaced implementation, op for op (one param group): three perturbation passes, then whole-tensor
    draws for the MeZO update or for the h replayed slots."""

    def __init__(self, params, lr, *, eps=1e-3, betas=(0.7, 0.9), window=10, weight_decay=0.0, seed=0):
        self.params, self.lr, self.eps, self.betas, self.window = list(params), lr, eps, betas, window
        self.wd, self.seed, self.t, self.seeds, self.projections = weight_decay, seed, 0, [], []

    def _perturb(self, seed, scale):
        gen = torch.Generator().manual_seed(seed)
        for p in self.params:
            p.add_(_normal(p, gen), alpha=scale)

    @torch.no_grad()
    def step(self, closure):
        seed = perturbation_seed(self.seed, self.t)
        self._perturb(seed, self.eps)
        loss_plus = torch.as_tensor(closure()).detach()
        self._perturb(seed, -2.0 * self.eps)
        loss_minus = torch.as_tensor(closure()).detach()
        self._perturb(seed, self.eps)
        proj = float((loss_plus.double() - loss_minus.double()) / (2.0 * self.eps))
        keep = max(self.window, 1)
        self.seeds, self.projections = (self.seeds + [seed])[-keep:], (self.projections + [proj])[-keep:]
        if self.window < 2 or self.t <= self.window:
            gen = torch.Generator().manual_seed(seed)
            steps = [_normal(p, gen).mul_(proj) for p in self.params]
        else:
            h, (b1, b2) = len(self.seeds), self.betas
            gens = [torch.Generator().manual_seed(s) for s in self.seeds]
            steps = []
            for p in self.params:
                acc = torch.promote_types(p.dtype, torch.float32)
                m = torch.zeros(p.shape, dtype=acc)
                v = torch.zeros_like(m) if b2 > 0 else None
                for i, gen in enumerate(gens):
                    z = _normal(p, gen).to(acc)
                    m.add_(z, alpha=b1 ** (h - 1 - i) * self.projections[i])
                    if v is not None:
                        v.addcmul_(z, z, value=b2 ** (h - 1 - i) * self.projections[i] ** 2)
                steps.append(m.div_(v.sqrt_().add_(1e-5) if v is not None else 1.0 + 1e-5).mul_(100.0))
        for p, s in zip(self.params, steps):
            if self.wd:
                s.add_(p, alpha=self.wd)
            p.sub_(s.to(p.dtype), alpha=self.lr)
        self.t += 1
        return loss_plus


class _Net(nn.Module):
    """Odd shapes: 1073, 29, 87 and 9 elements (the last below 16, which takes torch's serial sampler), plus a
    non-contiguous leaf (transposed storage), which takes the whole-tensor path."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(37, 29).to(dtype), nn.Linear(29, 3, bias=False).to(dtype)
        self.c = nn.Linear(3, 3).to(dtype)  # 9 + 3 elements
        self.t = nn.Parameter(torch.randn(3, 5, dtype=dtype).t())  # (5, 3), not contiguous

    def forward(self, x):
        return self.c(self.b(torch.tanh(self.a(x)))) + x[:, :5] @ self.t


def _data(dtype):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 37, generator=gen).to(dtype), torch.randint(0, 3, (16,), generator=gen)


def _loss(model, x, y):
    return lambda: nn.functional.cross_entropy(model(x).float(), y)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 64 elements (a multiple of every vector-loop stride, 64 for bf16 on AVX-512) and a thread
    hand-off for every piece, so the piecewise and parallel paths run on small tensors."""
    monkeypatch.setattr(optimizer, "CHUNK", 64)
    monkeypatch.setattr(optimizer, "PARALLEL_MIN", 16)


@pytest.mark.parametrize("size", [9, 16, 17, 64, 79, 80, 100, 1037, 4096 + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_chunked_draws_continue_the_stream_bit_for_bit(small_pieces, size, dtype):
    """Why pieces are allowed: torch's normal_ of 16-aligned pieces (last >= 16) equals one whole draw, and
    leaves the generator in the same state."""
    param = torch.empty(size, dtype=dtype)
    spans = optimizer._spans(param)
    assert spans[0][0] == 0 and spans[-1][1] == size and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all((b - a) % 64 == 0 for a, b in spans[:-1]) and (len(spans) == 1 or spans[-1][1] - spans[-1][0] >= 16)
    whole_gen, piece_gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    whole = _normal(param, whole_gen)
    streams = optimizer._Streams([param], [7])
    streams.gens = [piece_gen]
    pieces = torch.cat([zs[0].clone() for _, zs in streams.pieces(param)])
    assert all(row.numel() <= 64 + 15 for row in streams.rows[dtype])  # scratch is a piece, not the tensor
    assert torch.equal(whole, pieces)
    assert torch.equal(_normal(param, whole_gen), _normal(param, piece_gen))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [dict(window=4), dict(window=4, betas=(0.9, 0.0), weight_decay=0.05),
                                    dict(window=0, weight_decay=0.1)], ids=["adaptive", "beta2_zero_wd", "mezo"])
def test_step_is_bit_identical_to_the_plain_per_tensor_code(small_pieces, threads, dtype, kwargs):
    x, y = _data(dtype)
    fast_model, plain_model = _Net(dtype), _Net(dtype)
    fast = AdaMeZO(fast_model.parameters(), lr=1e-3, seed=3, **kwargs)
    plain = PlainAdaMeZO(plain_model.parameters(), lr=1e-3, seed=3, **kwargs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(9):  # window 4: 5 MeZO warm-up steps, then 4 adaptive ones
            assert torch.equal(fast.step(_loss(fast_model, x, y)), plain.step(_loss(plain_model, x, y)))
    finally:
        torch.set_num_threads(before)
    for p, q in zip(fast_model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)
    assert not fast_model.t.is_contiguous()


def test_fast_step_equals_the_dense_reference_on_pieces(small_pieces):
    x, y = _data(torch.float64)
    model = _Net(torch.float64)
    ref_model = copy.deepcopy(model)
    kwargs = dict(eps=1e-3, betas=(0.7, 0.9), window=3, weight_decay=0.01, seed=5)
    opt = AdaMeZO(model.parameters(), lr=1e-4, **kwargs)
    ref = ReferenceAdaMeZO(list(ref_model.parameters()), lr=1e-4, **kwargs)
    for _ in range(8):
        opt.step(_loss(model, x, y))
        ref.step(_loss(ref_model, x, y))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert_close("theta", q, p, 1e-10)


def test_norm_schedule_ablation_and_nonfinite_restore_on_pieces(small_pieces):
    x, y = _data(torch.float32)
    model, plain_model = _Net(torch.float32), _Net(torch.float32)
    schedule = [0.1, 0.02, 0.3]
    opt = MeZO(model.parameters(), lr=1e-2, norm_schedule=schedule)
    for target in schedule:
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        opt.step(_loss(model, x, y))
        moved = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
        assert float(moved.norm()) == pytest.approx(target, rel=1e-5)
    before = [p.detach().clone() for p in plain_model.parameters()]
    with pytest.raises(FloatingPointError, match="restored"):
        AdaMeZO(plain_model.parameters(), lr=1e-3).step(lambda: torch.tensor(float("inf")))
    for p, b in zip(plain_model.parameters(), before):
        assert_close("restored", b, p, 1e-6)


def test_no_tensor_is_kept_between_steps():
    x, y = _data(torch.float32)
    model = _Net(torch.float32)
    opt = AdaMeZO(model.parameters(), lr=1e-3, window=2)
    for _ in range(5):
        opt.step(_loss(model, x, y))
    assert not [k for k, v in vars(opt).items() if isinstance(v, torch.Tensor)]
    assert all(not isinstance(v, torch.Tensor) for v in opt.state["zo"].values())


def test_readme_usage_block_runs(run_card_snippet):
    """The card's Usage block, executed as written on a tiny Llama (the names it assumes: model, batch)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    scope = run_card_snippet(README, "## Usage\n", {"model": model, "batch": {"input_ids": ids, "labels": ids}})
    assert scope["opt"].forward_passes == 2 and torch.isfinite(scope["loss"])


def test_benchmark_writes_interleaved_ratios(tmp_path):
    """The speed benchmark's measuring function on the tiny LM (one round): every arm timed, ratios to MeZO."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "adamezo_step.py"
    spec = importlib.util.spec_from_file_location("adamezo_step", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    before = torch.get_num_threads()
    try:
        run = bench.measure("tiny", "full", ["mezo", "adamezo"], 1, 1, window=2)
    finally:
        torch.set_num_threads(before)
    rows = {r["arm"]: r for r in run["rows"]}
    assert rows["mezo"]["ratio_to_mezo_of_medians"] == 1.0 and rows["adamezo"]["step_s_median"] > 0
    assert {"cpu_model", "torch_threads", "blas", "git_sha", "loadavg_start"} <= set(run["machine"])
    assert "," not in run["machine"]["blas"]
