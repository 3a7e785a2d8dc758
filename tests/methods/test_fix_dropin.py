"""FiX / FoX as drop-in attention for Hugging Face Llama-family decoders (``convert_to_fix``), issue 9.

Ground truths: the room's float64 references (``reference.py``) for the masked kernels, and the unconverted host
model itself, which FoX without a gate must reproduce. Then through transformers' own API: padding, ``generate``
with and without the cache (greedy and beam), ``save_pretrained`` / ``AutoModelForCausalLM.from_pretrained`` (also in
a fresh interpreter after only ``import icml26.methods.fix_attention``), ``Trainer``, and bad input.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,  # noqa: E402
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Trainer,
                          TrainingArguments)

from icml26.core.testing import assert_close, tiny_tensor  # noqa: E402
from icml26.methods.fix_attention import (FiXAttention, FoXAttention, convert_to_fix,  # noqa: E402
                                          fix_attention_chunked, fox_attention_chunked)
from icml26.methods.fix_attention.dropin import (FiXDropInAttention, FixLlamaForCausalLM,  # noqa: E402
                                                 FoXDropInAttention, ForgetGateCacheLayer)
from icml26.methods.fix_attention.reference import (fix_attention_reference, fox_attention_reference,  # noqa: E402
                                                    head_rms_norm)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 61
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
HOSTS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 4}),   # the conversion turns the window off
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),                            # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),              # q/k norms, H * Dh != D
}
README = pathlib.Path(__file__).parents[2] / "src/icml26/methods/fix_attention/README.md"


def _host(kind: str = "llama", seed: int = 0):
    config_cls, model_cls, extra = HOSTS[kind]
    torch.manual_seed(seed)
    return model_cls(config_cls(**SIZES, **extra)).eval()


def _converted(variant: str, kind: str = "llama", seed: int = 0, **options):
    model = convert_to_fix(_host(kind, seed), variant, **options)
    torch.manual_seed(seed + 1)
    # Gates far from their init, so a wrong decay (or padding that decays) shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(key in name for key in ("gate", "A_log", "dt_bias", "output_norm")):
                p.add_(torch.randn_like(p) * 0.5)
    return model.eval()


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


# ---------------------------------------------------------------------------------------------- masked kernels
@pytest.mark.parametrize("n_pre", [0, 5])
@pytest.mark.parametrize("t", [1, 13, 70])
def test_masked_fix_kernel_equals_reference(t, n_pre):
    """Padding keys (left, right, and inside a decode prefix) masked in the chunked kernel == float64 reference."""
    b, h, d, total = 3, 2, 8, n_pre + t
    q, k, v = (tiny_tensor(b, h, total, d, seed=i, dtype=torch.float64) for i in range(3))
    log_f = torch.nn.functional.logsigmoid(tiny_tensor(b, h, total, d, seed=4, dtype=torch.float64) * 2 + 1)
    key_mask = torch.ones(b, total, dtype=torch.bool)
    key_mask[0, :3] = False          # left padding
    key_mask[1, total - 2:] = False  # right padding
    key_mask[2, 3:5] = False         # a hole (log f = 0 there too)
    log_f = log_f.masked_fill(~key_mask[:, None, :, None], 0.0)
    q_new = q[:, :, n_pre:].clone().requires_grad_()
    k_new = k[:, :, n_pre:].clone().requires_grad_()
    v_new = v[:, :, n_pre:].clone().requires_grad_()
    lf_new = log_f[:, :, n_pre:].clone().requires_grad_()
    prefix = {}
    if n_pre:
        # The decode cache holds values decayed to the position before the first new token.
        decay = (log_f[:, :, :n_pre].flip(2).cumsum(2).flip(2) - log_f[:, :, :n_pre]).exp()
        prefix = dict(prefix_k=k[:, :, :n_pre], prefix_v=v[:, :, :n_pre] * decay)
    out = fix_attention_chunked(q_new, k_new, v_new, lf_new, key_mask=key_mask, chunk_size=4, **prefix)
    rows = torch.arange(n_pre, total)
    expected = fix_attention_reference(q, k, v, log_f, rows=rows, key_mask=key_mask)
    real = key_mask[:, n_pre:, None].expand(b, t, d).unsqueeze(1).expand(b, h, t, d)
    assert_close("masked kernel", expected[real], out[real], 1e-12)
    if t > 1 and not n_pre:
        # Gradients on rows 1 and 2, where every query sees a real key (the reference's all-masked rows are NaN).
        probe = tiny_tensor(*out.shape, seed=7, dtype=out.dtype) * real
        probe[0] = 0
        got = [g[1:] for g in torch.autograd.grad(out, (q_new, k_new, v_new, lf_new), probe)]
        leaves = [x[1:].clone().requires_grad_() for x in (q, k, v, log_f)]
        ref = fix_attention_reference(*leaves, key_mask=key_mask[1:])
        want = torch.autograd.grad(ref, leaves, probe[1:])
        for a, w in zip(got, want):
            assert_close("masked kernel gradient", w, a, 1e-10)


@pytest.mark.parametrize("tq", [1, 9])
def test_masked_fox_kernel_equals_reference(tq):
    b, h, d, tk = 2, 2, 8, 9
    q, k, v = (tiny_tensor(b, h, tk, d, seed=i, dtype=torch.float64) for i in range(3))
    log_f = torch.nn.functional.logsigmoid(tiny_tensor(b, h, tk, seed=4, dtype=torch.float64))
    key_mask = torch.ones(b, tk, dtype=torch.bool)
    key_mask[0, :2] = False
    out = fox_attention_chunked(q[:, :, tk - tq:], k, v, log_f, key_mask=key_mask)
    expected = fox_attention_reference(q, k, v, log_f, rows=torch.arange(tk - tq, tk), key_mask=key_mask)
    real = key_mask[:, None, tk - tq:, None].expand_as(out)
    assert_close("masked kernel", expected[real], out[real], 1e-12)


# ------------------------------------------------------------------------------------------ host equivalence
@pytest.mark.parametrize("kind", sorted(HOSTS))
def test_fox_without_gate_is_the_host_model_padded_and_cached(kind):
    """FoX with f = 1 and RoPE is the host's softmax attention: equal logits on a left-padded batch, and equal
    greedy generations with the cache (GQA, Qwen2 biases, Qwen3 q/k norms and head_dim all exercised)."""
    host = _host(kind)
    ids, mask = _padded(_tokens(3, 10), [10, 7, 4], "left")
    if kind == "mistral":
        host.config.sliding_window = None   # the converted model attends to the whole prefix
    expected = host(ids, attention_mask=mask).logits
    gen_expected = host.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model = convert_to_fix(host, "fox", fgate_type="none")
    assert all(isinstance(layer.self_attn, FoXDropInAttention) for layer in model.model.layers)
    real = mask.bool()
    assert_close("gate-free FoX logits", expected[real], model(ids, attention_mask=mask).logits[real], 1e-5)
    gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, gen_expected)


def test_fix_drop_in_layer_equals_the_reference_path():
    """The drop-in FiX layer on a right-padded batch == o_proj(RMSNorm(float64 reference)) on the real tokens."""
    model = _converted("fix", gate_layer0_source="hidden").double()
    layer = model.model.layers[1].self_attn
    assert isinstance(layer, FiXDropInAttention)
    x = tiny_tensor(2, 11, 32, seed=3, dtype=torch.float64)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 6:] = False
    positions = torch.arange(11)[None]
    cos_sin = model.model.rotary_emb(x, positions)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()[None, None] & mask[:, None, None, :]
    out, _ = layer(x, position_embeddings=cos_sin, attention_mask=causal)

    q, k, v = layer._project(x, cos_sin)
    log_f = layer.log_forget(x).masked_fill(~mask[:, None, :, None], 0.0)
    rep = lambda z: z.repeat_interleave(2, dim=1)  # noqa: E731 (G = 2 key-value heads, 4 query heads)
    u = fix_attention_reference(q, rep(k), rep(v), rep(log_f), key_mask=mask)
    o = head_rms_norm(u, None, layer.cfg.norm_eps) * layer.output_norm.weight.view(1, 1, 1, -1)
    expected = layer.o_proj(o.transpose(1, 2).reshape(2, 11, 32))
    assert_close("drop-in FiX layer", expected[mask], out[mask], 1e-10)


# --------------------------------------------------------------------------------------- padding and the cache
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("variant", ["fix", "fox"])
def test_padded_batch_equals_unpadded_sequences(variant, side):
    model = _converted(variant)
    full = _tokens(3, 12)
    lengths = [12, 8, 5]
    ids, mask = _padded(full, lengths, side)
    logits = model(ids, attention_mask=mask).logits
    for row, n in enumerate(lengths):
        alone = model(full[row:row + 1, :n]).logits[0]
        got = logits[row, 12 - n:] if side == "left" else logits[row, :n]
        assert_close("padded logits", alone, got, 1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("variant", ["fix", "fox"])
def test_generate_with_cache_equals_without(variant, kind):
    """Greedy generation from a left-padded batch: tokens and every step's logits agree with and without the
    cache; the cache holds FiX's decayed values (or FoX's gates) in a ForgetGateCacheLayer."""
    model = _converted(variant, kind)
    ids, mask = _padded(_tokens(2, 9, seed=5), [9, 6], "left")
    runs = {}
    for use_cache in (True, False):
        runs[use_cache] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                         use_cache=use_cache, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    assert_close("cached generate logits", torch.stack(runs[False].logits), torch.stack(runs[True].logits), 1e-5)
    cache = runs[True].past_key_values
    assert all(isinstance(layer, ForgetGateCacheLayer) for layer in cache.layers)
    assert cache.layers[0].values.shape[1] == 2          # G key-value heads, the size of a plain KV cache
    assert (cache.layers[0].log_f is None) == (variant == "fix")


def test_beam_search_reorders_the_forget_cache():
    model = _converted("fox")
    ids = _tokens(2, 6, seed=8)
    kwargs = dict(max_new_tokens=5, do_sample=False, num_beams=3, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


def test_static_cache_is_refused():
    model = _converted("fix")
    with pytest.raises(TypeError, match="DynamicCache"):
        model.generate(_tokens(1, 4), max_new_tokens=2, do_sample=False, cache_implementation="static",
                       pad_token_id=0)


# ------------------------------------------------------------------------------------------- save, reload, train
def test_save_pretrained_and_auto_reload_give_equal_outputs(tmp_path, caplog):
    model = _converted("fix", kind="qwen2")
    ids, mask = _padded(_tokens(2, 8), [8, 5], "left")
    expected = model(ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "icml26_fix_qwen2" and saved["fix_attention"]["attention"] == "fix"
    with caplog.at_level(logging.WARNING):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded).__name__ == "FixQwen2ForCausalLM" and isinstance(loaded, Qwen2ForCausalLM)
    assert not [r for r in caplog.records if re.search("upgrade|newly initialized|not used", r.getMessage())]
    torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, expected, rtol=0, atol=0)


def test_reload_in_a_fresh_interpreter_after_importing_the_room(tmp_path):
    """Only ``import icml26.methods.fix_attention`` before ``AutoModelForCausalLM.from_pretrained`` (no class
    imported by name), and no 'upgrade transformers' message."""
    model = _converted("fox")
    ids = _tokens(2, 7)
    model.save_pretrained(tmp_path / "model")
    torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    script = (
        "import sys, torch\n"
        "import icml26.methods.fix_attention\n"
        "from transformers import AutoModelForCausalLM\n"
        f"d = {str(tmp_path)!r}\n"
        "m = AutoModelForCausalLM.from_pretrained(d + '/model').eval()\n"
        "e = torch.load(d + '/expected.pt')\n"
        "torch.testing.assert_close(m(e['ids']).logits, e['logits'], rtol=0, atol=0)\n"
        "print(type(m).__name__)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "FixLlamaForCausalLM"
    assert "upgrad" not in (done.stdout + done.stderr).lower()


@pytest.mark.parametrize("variant", ["fix", "fox"])
def test_trainer_steps_give_finite_gate_grads_and_lower_the_loss(variant, tmp_path):
    model = _converted(variant)
    model.train()
    ids, mask = _padded(_tokens(4, 12, seed=11), [12, 12, 9, 6], "right")
    labels = ids.masked_fill(mask == 0, -100)
    rows = [{"input_ids": i, "attention_mask": m, "labels": lab} for i, m, lab in zip(ids, mask, labels)]

    def loss() -> float:
        with torch.no_grad():
            return model(ids, attention_mask=mask, labels=labels).loss.item()

    before = loss()
    grads = {}
    hooks = [p.register_hook(lambda g, n=name: grads.setdefault(n, g.clone()))
             for name, p in model.named_parameters() if "gate" in name or "A_log" in name]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=3e-3)
    result = Trainer(model=model, args=args, train_dataset=rows).train()
    for hook in hooks:
        hook.remove()
    assert result.global_step == 2
    assert grads and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    assert loss() < before


# ----------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("sizes", [(0, 4), (32, 0), (30, 4), (32.0, 4), (True, 1)])
@pytest.mark.parametrize("cls", [FiXAttention, FoXAttention])
def test_layers_reject_bad_sizes_at_construction(cls, sizes):
    with pytest.raises(ValueError, match="d_model|n_heads"):
        cls(*sizes)


@pytest.mark.parametrize("cls", [FiXAttention, FoXAttention])
def test_layers_reject_a_2d_input_at_entry(cls):
    layer = cls(32, 4, gate_layer0_source="hidden") if cls is FiXAttention else cls(32, 4)
    with pytest.raises(ValueError, match=r"\(batch, time, 32\).*unsqueeze"):
        layer(torch.randn(7, 32))
    with pytest.raises(ValueError, match="batch, time, 32"):
        layer(torch.randn(1, 7, 16))
    with pytest.raises(TypeError, match="floating"):
        layer(torch.ones(1, 7, 32, dtype=torch.long))


def test_drop_in_layer_rejects_a_2d_input():
    layer = _converted("fix").model.layers[0].self_attn
    with pytest.raises(ValueError, match="batch, time, 32"):
        layer(torch.randn(5, 32))


@pytest.mark.parametrize("call,error,match", [
    (lambda m: convert_to_fix(m, "gla"), ValueError, "variant"),
    (lambda m: convert_to_fix(m, "fix", gate_form="cubic"), ValueError, "gate_form"),
    (lambda m: convert_to_fix(m, "fix", window=3), TypeError, "unknown option"),
    (lambda m: convert_to_fix(m, "fox", qk_norm=True), ValueError, "qk_norm"),
    (lambda m: convert_to_fix(m, "fix", rope_base=500.0), ValueError, "rope_base"),
    (lambda m: convert_to_fix(m.model, "fix"), TypeError, "supports"),
])
def test_bad_conversions_raise_before_changing_the_model(call, error, match):
    model = _host()
    names = [name for name, _ in model.named_parameters()]
    with pytest.raises(error, match=match):
        call(model)
    assert type(model) is LlamaForCausalLM and model.config.model_type == "llama"
    assert [name for name, _ in model.named_parameters()] == names


def test_second_conversion_and_embeds_without_ids_raise():
    model = _converted("fix")
    assert type(model) is FixLlamaForCausalLM
    with pytest.raises(TypeError, match="already converted"):
        convert_to_fix(model, "fox")
    with pytest.raises(ValueError, match="token ids"):
        model(inputs_embeds=model.model.embed_tokens(_tokens(1, 4)))


# ------------------------------------------------------------------------------------------------ README snippet
def test_readme_drop_in_snippet_runs(tmp_path, monkeypatch, run_card_snippet):
    """Executes the README's drop-in python block as written (it asserts its own results)."""
    monkeypatch.chdir(tmp_path)
    run_card_snippet(README, "<!-- test_fix_dropin runs this block -->")
    assert (tmp_path / "fix-llama" / "config.json").exists()


def test_plain_host_checkpoint_loads_into_the_fix_class_with_initialised_gates(tmp_path):
    """``FixLlamaForCausalLM.from_pretrained(llama_dir)``: host weights loaded as they are, gates that the checkpoint
    lacks drawn by the gate's own init (A in (0, 16], softplus(dt_bias) in [1e-3, 1e-1]), not left empty."""
    host = _host()
    host.save_pretrained(tmp_path)
    model = FixLlamaForCausalLM.from_pretrained(tmp_path)
    assert model.config.fix_attention["attention"] == "fix"
    for name, p in host.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), p, rtol=0, atol=0)
    for layer in model.model.layers:
        attn = layer.self_attn
        a, dt = attn.A_log.exp(), torch.nn.functional.softplus(attn.dt_bias)
        assert (a > 0).all() and (a <= 16).all() and (dt >= 0.99e-3).all() and (dt <= 0.101).all()
        bound = attn.gate_up.in_features ** -0.5
        assert attn.gate_up.weight.abs().max() <= bound and attn.gate_up.weight.std() > bound / 4
    assert torch.isfinite(model(_tokens(1, 6)).logits).all()
    fox = FixLlamaForCausalLM.from_pretrained(tmp_path, fix_attention={"attention": "fox", "fgate_type": "none"})
    assert isinstance(fox.model.layers[0].self_attn, FoXDropInAttention) and fox.config.fix_attention["rope"] is True
    assert_close("plain checkpoint as gate-free FoX", host(_tokens(1, 6)).logits, fox(_tokens(1, 6)).logits, 1e-5)
