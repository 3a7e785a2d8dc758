"""Hyper-connections (KromHC, mHC, mHC-lite, HC) as a drop-in residual for Llama-family decoders, issue 9.

Ground truths: the unconverted host model (the identity-equivalent init must reproduce its logits) and the room's
reference path (``reference.use_reference``: explicit per-token sums) for the converted model with hyper-connection
parameters far from their init. Then through transformers' own API: padding, ``generate`` with and without the
cache, ``save_pretrained`` / ``AutoModelForCausalLM.from_pretrained`` (also in a fresh interpreter after only
``import icml26.methods.kromhc``), ``Trainer`` (also with gradient checkpointing), and bad input.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,  # noqa: E402
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Trainer,
                          TrainerCallback, TrainingArguments)

from icml26.core.testing import assert_close  # noqa: E402
from icml26.methods.kromhc import (HC, MHC, KromHC, MHCLite, convert_to_hyper_connections,  # noqa: E402
                                   identity_equivalent_init_)
from icml26.methods.kromhc.dropin import KromHCLlamaConfig, KromHCLlamaForCausalLM  # noqa: E402
from icml26.methods.kromhc.reference import reference_coefficients, use_reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 61
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
HOSTS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 4}),   # the host's own window mask is kept
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),                            # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),              # q/k norms, H * Dh != D
}
KINDS = {"kromhc": (KromHC, 4), "mhc": (MHC, 3), "mhc_lite": (MHCLite, 3), "hc": (HC, 4)}
README = pathlib.Path(__file__).parents[2] / "src/icml26/methods/kromhc/README.md"


def _host(host: str = "llama", seed: int = 0, **extra):
    config_cls, model_cls, defaults = HOSTS[host]
    torch.manual_seed(seed)
    return model_cls(config_cls(**SIZES, **{**defaults, **extra})).eval()


def _perturb(model: torch.nn.Module, scale: float = 0.5, seed: int = 3) -> torch.nn.Module:
    """Move every hyper-connection parameter off its init: at init the streams are identical copies, which would
    hide a wrong mixing, a leaking pad or a wrong cache."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_hc." in name:
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def _converted(kind: str = "kromhc", host: str = "llama", perturb: bool = True, **options):
    model = convert_to_hyper_connections(_host(host), kind, KINDS[kind][1], **options)
    return _perturb(model) if perturb else model.eval()


def _tokens(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _padded(ids: torch.Tensor, lengths: list[int], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``ids`` cut to ``lengths`` and padded (token 0) on ``side`` to the full width; (ids, mask)."""
    out, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    t = ids.shape[1]
    for row, n in enumerate(lengths):
        span = slice(t - n, t) if side == "left" else slice(0, n)
        out[row, span], mask[row, span] = ids[row, :n], 1
    return out, mask


def _hc_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if "_hc." in name}


# ---------------------------------------------------------------------------------------- identity-equivalent init
@pytest.mark.parametrize("kind", list(KINDS))
def test_identity_init_on_identical_streams_sums_pre_to_one_posts_one_and_keeps_each_stream(kind):
    cls, n = KINDS[kind]
    layer = identity_equivalent_init_(cls(n, 8, home_stream=n - 1)).double()
    stream = torch.randn(5, 1, 8, dtype=torch.float64).expand(5, n, 8)
    h_pre, h_res, h_post = reference_coefficients(layer, stream)
    assert_close("sum H_pre", torch.ones(5, dtype=torch.float64), h_pre.sum(-1), 1e-6)
    assert torch.equal(h_post, torch.ones_like(h_post))
    assert_close("columns of H_res", torch.ones(5, n, dtype=torch.float64), h_res.sum(-2), 1e-6)
    if kind != "hc":   # the home stream keeps the official ratio sigmoid(1) / sigmoid(-1) = e to the others
        assert_close("home / other", torch.full((5,), torch.e, dtype=torch.float64), h_pre[:, -1] / h_pre[:, 0], 1e-6)


@pytest.mark.parametrize("host", list(HOSTS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_converted_model_equals_the_host_at_init_on_a_padded_batch(host, kind):
    ids, mask = _padded(_tokens(3, 9), [9, 6, 2], "left")
    with torch.no_grad():
        expected = _host(host)(ids, attention_mask=mask).logits
        model = convert_to_hyper_connections(_host(host), kind, KINDS[kind][1]).eval()
        got = model(ids, attention_mask=mask).logits
    assert all(isinstance(layer.attn_hc, KINDS[kind][0]) for layer in model.model.layers)
    assert_close(f"{host}/{kind} logits", expected, got, 1e-6, atol=1e-5)


def test_identity_init_is_exact_in_float64_and_the_official_init_is_not():
    ids = _tokens(2, 7)
    with torch.no_grad():
        expected = _host().double()(ids).logits
        got = convert_to_hyper_connections(_host().double(), "kromhc", 4)(ids).logits
        official = convert_to_hyper_connections(_host(), "kromhc", 4, init="official")(ids).logits
    assert_close("float64 logits", expected, got, 1e-13)
    assert (official.double() - expected).abs().max() > 1e-3   # the official biases change the function


# ---------------------------------------------------------------------------------------------- fast == reference
@pytest.mark.parametrize("kind", ["kromhc", "mhc_lite"])
def test_converted_model_fast_path_matches_the_reference_outputs_and_gradients(kind):
    model = _converted(kind).double()
    ids, mask = _padded(_tokens(2, 5), [5, 3], "right")
    labels = ids.masked_fill(mask == 0, -100)

    def run():
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    fast_logits, fast_grads = run()
    with use_reference(model):
        ref_logits, ref_grads = run()
    assert_close("logits", ref_logits, fast_logits, 1e-12)
    for name, grad in ref_grads.items():
        assert_close(f"grad {name}", grad, fast_grads[name], 1e-9, atol=1e-14)


# -------------------------------------------------------------------------------------------- padding, generate
@pytest.mark.parametrize("host, kind", [("llama", "kromhc"), ("qwen3", "kromhc"), ("llama", "mhc_lite")])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_gives_each_sequence_its_unpadded_logits(host, kind, side):
    model = _converted(kind, host)
    ids = _tokens(3, 8)
    lengths = [8, 5, 3]
    padded, mask = _padded(ids, lengths, side)
    with torch.no_grad():
        batch = model(padded, attention_mask=mask).logits
        for row, n in enumerate(lengths):
            alone = model(ids[row: row + 1, :n]).logits[0]
            real = batch[row][mask[row].bool()]
            assert_close(f"row {row} ({side})", alone, real, 1e-5, atol=1e-6)


@pytest.mark.parametrize("host, kind", [("llama", "kromhc"), ("qwen2", "kromhc"), ("llama", "mhc")])
def test_greedy_generate_agrees_with_and_without_the_cache(host, kind):
    model = _converted(kind, host)
    ids, mask = _padded(_tokens(2, 6, seed=5), [6, 3], "left")
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    cached = model.generate(ids, use_cache=True, **common)
    plain = model.generate(ids, use_cache=False, **common)
    assert torch.equal(cached.sequences, plain.sequences)
    for step, (a, b) in enumerate(zip(cached.scores, plain.scores)):
        assert_close(f"scores step {step}", b, a, 1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ save / reload
@pytest.mark.parametrize("kind", ["kromhc", "mhc_lite", "hc"])
def test_save_and_auto_from_pretrained_round_trip(tmp_path, kind):
    model = _converted(kind, res_logit_gap=4.0) if kind != "hc" else _converted(kind)
    ids, mask = _padded(_tokens(2, 7), [7, 4], "left")
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(loaded) is KromHCLlamaForCausalLM and type(loaded.config) is KromHCLlamaConfig
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert loaded.config.hyper_connections == model.config.hyper_connections
    if kind == "mhc_lite":   # the permutation matrices are a non-persistent buffer: rebuilt, not left empty
        assert torch.equal(loaded.model.layers[1].mlp_hc.perms, model.model.layers[1].mlp_hc.perms)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids, attention_mask=mask).logits, expected)


def test_reload_in_a_fresh_interpreter_after_only_importing_the_room(tmp_path):
    model = _converted("kromhc", "qwen3")
    ids = _tokens(2, 5)
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    model.save_pretrained(tmp_path / "model")
    script = ("import sys, torch\n"
              "import icml26.methods.kromhc\n"
              "from transformers import AutoModelForCausalLM\n"
              "exp = torch.load(sys.argv[1])\n"
              "m = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()\n"
              "print(type(m).__name__, torch.equal(m(exp['ids']).logits, exp['logits']))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "expected.pt"), str(tmp_path / "model")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["KromHCQwen3ForCausalLM", "True"]
    assert "upgrade" not in res.stderr.lower()


def test_plain_host_checkpoint_loads_into_the_converted_class_as_the_host(tmp_path):
    host = _host()
    host.save_pretrained(tmp_path)
    loaded, info = KromHCLlamaForCausalLM.from_pretrained(
        tmp_path, hyper_connections={"kind": "mhc", "num_streams": 3}, output_loading_info=True)
    assert "model.layers.0.attn_hc.static_alpha" in info["missing_keys"]
    assert isinstance(loaded.model.layers[0].attn_hc, MHC)
    ids = _tokens(2, 6)
    with torch.no_grad():
        assert_close("logits", host(ids).logits, loaded.eval()(ids).logits, 1e-6, atol=1e-5)


# ------------------------------------------------------------------------------------------------------ Trainer
class _GradProbe(TrainerCallback):
    """Records the hyper-connection gradients just before each optimizer step."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in _hc_parameters(model).items()})


@pytest.mark.parametrize("kind", ["kromhc", "mhc"])
def test_trainer_steps_give_finite_grads_and_update_the_hyper_connections(tmp_path, kind):
    model = _converted(kind, perturb=False).train()
    before = {n: p.detach().clone() for n, p in _hc_parameters(model).items()}
    ids, mask = _padded(_tokens(4, 10, seed=11), [10, 8, 6, 10], "right")
    data = [{"input_ids": i, "attention_mask": m, "labels": i.masked_fill(m == 0, -100)} for i, m in zip(ids, mask)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-2)
    probe = _GradProbe()
    result = Trainer(model=model, args=args, train_dataset=data, callbacks=[probe]).train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert len(probe.grads) == 3 and all(torch.isfinite(g).all() for step in probe.grads for g in step.values())
    # Step 1, from the identity init: every H_post gets a gradient.
    for i in range(2):
        for part in ("attn_hc", "mlp_hc"):
            assert probe.grads[0][f"model.layers.{i}.{part}.dynamic_beta_fn"].abs().max() > 0
    # Step 2: the streams differ (their H_post moved), so the residual logits get a gradient; step 3: so does
    # alpha_res, which multiplies phi_res (zero at init, moved in step 2). These gradients start small (the mixing acts
    # only on stream differences, through logits saturated by the official gap 8): alpha_res's first one (~1e-16)
    # moves it below float32 resolution. Every other HC parameter of the middle wrappers has moved.
    res = (slice(None), slice(1, None)) if kind == "mhc" else slice(4, None)
    assert probe.grads[1]["model.layers.1.attn_hc.static_alpha"][res].abs().max() > 0
    assert probe.grads[2]["model.layers.1.attn_hc.residual_scale"].abs().max() > 0
    changed = {n for n, p in _hc_parameters(model).items() if not torch.equal(p.detach(), before[n])}
    assert {n for n in before if n.startswith("model.layers.1.attn_hc.") and "residual_scale" not in n} <= changed


def test_the_last_wrappers_residual_mixing_does_not_reach_the_output():
    """The mean over streams of H_res^T X is the mean of X for every H_res whose rows sum to 1: the last wrapper's
    residual logits are inert (as under the official sum reduce), whatever the parameters."""
    model = _converted("kromhc").double()
    ids = _tokens(2, 6)
    model(ids, labels=ids).loss.backward()
    last, middle = model.model.layers[1].mlp_hc, model.model.layers[1].attn_hc
    assert middle.residual_scale.grad.abs() > 1e-6 and middle.static_alpha.grad[4:].abs().max() > 1e-6
    assert last.residual_scale.grad.abs() < 1e-14 and last.static_alpha.grad[4:].abs().max() < 1e-14


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = _tokens(2, 6)
    grads = []
    for checkpointing in (False, True):
        model = _converted("kromhc").train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert_close(name, grad, grads[1][name], 1e-6, atol=1e-9)


# -------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("args, options, error, match", [
    (("kromhc", 0), {}, ValueError, "num_streams must be at least 2"),
    (("kromhc", -4), {}, ValueError, "num_streams must be at least 2"),
    (("mhc", 1), {}, ValueError, "num_streams must be at least 2"),
    (("kromhc", 4.0), {}, TypeError, "num_streams must be an int"),
    (("kromhc", True), {}, TypeError, "num_streams must be an int"),
    (("kromhc", 6), {}, ValueError, "power of two"),
    (("mhc_lite", 8), {}, ValueError, "infeasible"),
    (("xhc", 4), {}, ValueError, "kind must be one of"),
    (("residual", 4), {}, ValueError, "kind must be one of"),
    (("kromhc", 4), {"init": "zeros"}, ValueError, "init must be one of"),
    (("kromhc", 4), {"streams": 4}, TypeError, "unknown option"),
    (("kromhc", 4), {"res_logit_gap": -1.0}, ValueError, "res_logit_gap"),
    (("mhc", 4), {"sinkhorn_iters": 0}, ValueError, "sinkhorn_iters"),
])
def test_bad_conversion_arguments_raise_before_the_model_changes(args, options, error, match):
    model = _host()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config
    with pytest.raises(error, match=match):
        convert_to_hyper_connections(model, *args, **options)
    assert type(model) is LlamaForCausalLM and model.config is config
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_identity_init_refuses_a_module_that_is_not_a_room_layer():
    with pytest.raises(TypeError, match="takes a room layer"):
        identity_equivalent_init_(torch.nn.Linear(4, 4))


def test_unsupported_and_already_converted_models_are_refused():
    model = _converted("kromhc")
    with pytest.raises(TypeError, match="already converted"):
        convert_to_hyper_connections(model, "mhc", 4)
    with pytest.raises(TypeError, match="supports LlamaForCausalLM"):
        convert_to_hyper_connections(_host().model, "kromhc", 4)   # the bare LlamaModel, not a causal LM


def test_wrong_input_ranks_raise_clear_errors():
    model = _converted("kromhc")
    with pytest.raises(ValueError, match=r"input_ids must be \(B, T\)"):
        model(_tokens(1, 5)[0])
    with pytest.raises(ValueError, match=r"inputs_embeds must be \(B, T, 32\)"):
        model(inputs_embeds=torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match=r"decoder layer 0 takes hidden states \(B, T, 32\)"):
        model.model.layers[0](torch.randn(2, 5, 4, 32))
    with pytest.raises(ValueError, match=r"takes the \(B, T, 4, 32\) streams"):
        model.model.layers[1](torch.randn(2, 5, 32))


# ------------------------------------------------------------------------------------------------ README snippet
def test_readme_drop_in_snippet_runs(tmp_path, monkeypatch, run_card_snippet):
    """Executes the README's drop-in python block as written (it asserts its own results)."""
    monkeypatch.chdir(tmp_path)
    run_card_snippet(README, "<!-- test_kromhc_dropin runs this block -->")
    assert (tmp_path / "kromhc-llama" / "config.json").exists()
