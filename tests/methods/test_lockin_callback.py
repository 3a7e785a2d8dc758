"""lockin in transformers' Trainer: ``LockInCallback`` records, on a tiny Llama built from a config (float64, no
download), exactly the records of the room's own ``LockInProbe`` run by hand on the same trajectory (the same
AdamW steps on the same batches); resuming from a checkpoint continues the records unchanged; with a peft LoRA model
(and with our own LoRA adapters) the probe stores only the trainable factors. The Fisher probe accepts HF dict
batches and equals the dense Fisher. Bad input (no trainable parameters, NaN losses, empty batches, bad options)
raises a clear error before the probe's state changes. The README's Trainer snippet is executed."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from icml26.core.adapters import AdapterConfig, LoRALinear, count_trainable_parameters, inject_adapters  # noqa: E402
from icml26.methods.lockin import LockInCallback, LockInConfig, LockInProbe, model_loss  # noqa: E402
from icml26.methods.lockin import reference as ref  # noqa: E402
from icml26.methods.lockin.geometry import flatten  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).resolve().parents[2] / "src/icml26/methods/lockin/README.md"
VOCAB, SEQ, LR = 32, 8, 1e-2


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(config).double()


def examples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """n sequences of SEQ tokens; the last example is right-padded (mask 0, label -100) so masks matter."""
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[-1, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def stack(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


TRAIN = examples(8, seed=1)
TASK_BATCH, BROAD_BATCH = stack(examples(3, seed=2)), stack(examples(4, seed=3))


def args(tmp_path, steps: int, **kw) -> TrainingArguments:
    """Plain AdamW at a constant rate, no clipping or decay, batches in dataset order: a trajectory that a hand
    loop can follow step by step."""
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps, learning_rate=LR,
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
                optim="adamw_torch", train_sampling_strategy="sequential", report_to=[], save_strategy="no",
                logging_steps=1000, use_cpu=True, seed=0, disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


def hand_trajectory(model, config: LockInConfig, steps: int, every: int) -> LockInProbe:
    """The room's own probe on a hand-written loop with Trainer's batches and optimizer: step t trains on rows
    4(t-1) .. 4t-1 of TRAIN (mod 8); the probe observes at 0 and after every ``every``-th step, in eval mode."""
    probe = LockInProbe(model, model_loss, model_loss, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    model.eval()
    probe.observe(0, model, TASK_BATCH, BROAD_BATCH)
    for step in range(1, steps + 1):
        start = 4 * (step - 1) % len(TRAIN)
        model.train()
        model(**stack(TRAIN[start:start + 4])).loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        if step % every == 0:
            probe.observe(step, model, TASK_BATCH, BROAD_BATCH)
    return probe


def assert_same_records(expected: list[dict], got: list[dict], rel: float = 1e-9) -> None:
    assert [r["step"] for r in expected] == [r["step"] for r in got]
    for e, g in zip(expected, got):
        assert set(e) == set(g), (sorted(e), sorted(g))
        for key in e:
            assert g[key] == pytest.approx(e[key], rel=rel, abs=1e-12), (e["step"], key)


# ------------------------------------------------------------------------------------- Trainer == hand loop
@pytest.mark.parametrize("curvature", ["fisher", "hessian"])
def test_callback_records_equal_the_probe_on_the_same_trajectory(tmp_path, curvature):
    config = LockInConfig(q=1, window=2, curvature=curvature)
    callback = LockInCallback(TASK_BATCH, BROAD_BATCH, config, every=2)
    trainer = Trainer(model=tiny_llama(), args=args(tmp_path, steps=8), train_dataset=TRAIN, callbacks=[callback])
    trainer.train()
    expected = hand_trajectory(tiny_llama(), config, steps=8, every=2).history
    assert_same_records(expected, callback.history)
    assert [r["step"] for r in callback.history] == [0, 2, 4, 6, 8]
    assert "overlap" in callback.history[-1] and callback.history[-1]["drift"] > 0
    logged = [h for h in trainer.state.log_history if "lockin/drift" in h]
    assert [h["step"] for h in logged] == [0, 2, 4, 6, 8]
    assert [h["lockin/drift"] for h in logged] == [r["drift"] for r in callback.history]
    assert trainer.model.training  # the probe's eval mode was undone


def test_resume_from_checkpoint_continues_the_records(tmp_path):
    config = LockInConfig(q=1, window=2, curvature="fisher")
    full = LockInCallback(TASK_BATCH, BROAD_BATCH, config, every=1)
    Trainer(model=tiny_llama(), args=args(tmp_path / "full", steps=4), train_dataset=TRAIN, callbacks=[full]).train()

    out = tmp_path / "resumed"
    first = LockInCallback(TASK_BATCH, BROAD_BATCH, config, every=1)
    Trainer(model=tiny_llama(), args=args(out, steps=4, save_strategy="steps", save_steps=3), train_dataset=TRAIN,
            callbacks=[first]).train()
    assert (out / "checkpoint-3" / "lockin_probe.pt").is_file()
    second = LockInCallback(TASK_BATCH, BROAD_BATCH, config, every=1)
    trainer = Trainer(model=tiny_llama(seed=5), args=args(out, steps=4), train_dataset=TRAIN, callbacks=[second])
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert_same_records(full.history, second.history)

    missing = LockInCallback(TASK_BATCH, BROAD_BATCH, config, every=1)
    (out / "checkpoint-3" / "lockin_probe.pt").unlink()
    with pytest.raises(FileNotFoundError, match="lockin_probe.pt is missing"):
        Trainer(model=tiny_llama(), args=args(out, steps=4), train_dataset=TRAIN,
                callbacks=[missing]).train(resume_from_checkpoint=str(out / "checkpoint-3"))


# ---------------------------------------------------------------------------------- only trainable parameters
def _assert_probe_stores_only(probe: LockInProbe, n_trainable: int, n_total: int) -> None:
    state = probe.state_dict()
    tensors = [state["theta0"], state["prev"], *state["updates"]]
    assert probe.num_parameters == n_trainable < n_total // 10
    assert all(t.numel() == n_trainable for t in tensors)
    if state["subspace"] is not None:
        assert state["subspace"].shape == (n_trainable, probe.config.q)
    assert all("lora" in n for n in probe.names)


def test_peft_lora_model_probe_follows_only_the_adapter_factors(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                                lora_dropout=0.0, init_lora_weights="gaussian"))
    n_trainable, n_total = model.get_nb_trainable_parameters()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    config = LockInConfig(q=1, window=2, curvature="fisher")
    callback = LockInCallback(TASK_BATCH, BROAD_BATCH, config, every=1)
    Trainer(model=model, args=args(tmp_path, steps=3), train_dataset=TRAIN, callbacks=[callback]).train()
    probe = callback.probe
    _assert_probe_stores_only(probe, n_trainable, n_total)
    assert len(probe.names) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    # the frozen base did not move, so the drift over the factors is the drift of the whole model
    named = dict(model.named_parameters())
    assert all(torch.equal(named[n], p) for n, p in base_before.items())
    now = flatten([named[n] for n in probe.names])
    assert callback.history[-1]["drift"] == pytest.approx(float((now - probe.theta0).norm()), rel=1e-12)
    assert all(math.isfinite(v) for r in callback.history for v in r.values())


def test_our_lora_adapters_probe_follows_only_the_adapter_factors():
    model = tiny_llama()
    n_total = sum(p.numel() for p in model.parameters())
    inject_adapters(model, AdapterConfig(r=2, alpha=4.0, target_modules=["q_proj", "v_proj"]),
                    lambda linear, r, alpha, name: LoRALinear(linear, r, alpha))
    probe = hand_trajectory(model, LockInConfig(q=1, window=2, curvature="fisher"), steps=2, every=1)
    _assert_probe_stores_only(probe, count_trainable_parameters(model), n_total)
    assert "overlap" not in probe.history[-1] and "subspace_curvature" in probe.history[-1]


# --------------------------------------------------------------------------------------- Fisher on dict batches
def test_fisher_probe_on_dict_batches_equals_the_dense_fisher():
    model = tiny_llama()
    probe = LockInProbe(model, model_loss, model_loss, LockInConfig(q=1, window=3, curvature="fisher"))
    probe.observe(0, model, TASK_BATCH, BROAD_BATCH)
    prev = copy.deepcopy(model)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(1e-2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i), dtype=p.dtype))
    rec = probe.observe(1, model, TASK_BATCH, BROAD_BATCH)
    # dense reference at theta_prev: one backward per example, each example sliced here by hand
    rows = [{k: v[i:i + 1] for k, v in BROAD_BATCH.items()} for i in range(len(BROAD_BATCH["input_ids"]))]
    grads = ref.dense_gradient_rows(prev, model_loss, rows)
    v = flatten(model.parameters()) - flatten(prev.parameters())
    first, second = ref.taylor_change_dense(grads.mean(0), ref.dense_fisher(grads), v)
    assert rec["harm_first_order"] == pytest.approx(first, rel=1e-9)
    assert rec["harm_second_order"] == pytest.approx(second, rel=1e-9)


# ---------------------------------------------------------------------------------------------------- bad input
def test_bad_input_raises_before_the_probe_changes():
    frozen = tiny_llama().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        LockInProbe(frozen, model_loss, model_loss)

    model = tiny_llama()
    poison = {"on": False}

    def broad(m, batch):
        loss = model_loss(m, batch)
        return loss * math.nan if poison["on"] else loss

    probe = LockInProbe(model, model_loss, broad, LockInConfig(q=1, window=2, curvature="fisher"))
    twin = LockInProbe(model, model_loss, broad, LockInConfig(q=1, window=2, curvature="fisher"))
    for p_ in (probe, twin):
        p_.observe(0, model, TASK_BATCH, BROAD_BATCH)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    before = copy.deepcopy(probe.state_dict())
    theta, w00 = flatten(model.parameters()).clone(), float(model.lm_head.weight[0, 0].detach())
    poison["on"] = True
    with pytest.raises(ValueError, match="broad loss is not finite"):
        probe.observe(1, model, TASK_BATCH, BROAD_BATCH)
    empty = {k: v[:0] for k, v in BROAD_BATCH.items()}
    poison["on"] = False
    with pytest.raises(ValueError, match="batch_broad is empty"):
        probe.observe(1, model, TASK_BATCH, empty)
    with pytest.raises(ValueError, match="batch_task is empty"):
        probe.observe(1, model, (), BROAD_BATCH)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = math.inf
    with pytest.raises(ValueError, match="parameters are not finite"):
        probe.observe(1, model, TASK_BATCH, BROAD_BATCH)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = w00
    after = probe.state_dict()
    assert torch.equal(after["prev"], before["prev"]) and after["history"] == before["history"]
    assert torch.equal(flatten(model.parameters()), theta)
    assert probe.observe(1, model, TASK_BATCH, BROAD_BATCH) == twin.observe(1, model, TASK_BATCH, BROAD_BATCH)

    with pytest.raises(ValueError, match="every must be an int"):
        LockInCallback(TASK_BATCH, BROAD_BATCH, every=0)
    with pytest.raises(ValueError, match="task_batch is empty"):
        LockInCallback({k: v[:0] for k, v in TASK_BATCH.items()}, BROAD_BATCH)
    with pytest.raises(ValueError, match="same leading"):
        LockInCallback(TASK_BATCH, {**BROAD_BATCH, "labels": BROAD_BATCH["labels"][:2]})
    with pytest.raises(TypeError, match="LockInConfig"):
        LockInCallback(TASK_BATCH, BROAD_BATCH, {"q": 2})


def test_nan_probe_loss_in_trainer_raises_before_any_optimizer_step(tmp_path):
    model = tiny_llama()
    start = flatten(model.parameters()).clone()
    callback = LockInCallback(TASK_BATCH, BROAD_BATCH, LockInConfig(q=1, window=2, curvature="fisher"),
                              broad_loss=lambda m, b: model_loss(m, b) * math.nan)
    trainer = Trainer(model=model, args=args(tmp_path, steps=2), train_dataset=TRAIN, callbacks=[callback])
    with pytest.raises(ValueError, match="at step 0: the broad loss is not finite"):
        trainer.train()
    assert torch.equal(flatten(model.parameters()), start) and callback.history == []
    no_labels = LockInCallback({k: v for k, v in TASK_BATCH.items() if k != "labels"}, BROAD_BATCH)
    with pytest.raises(ValueError, match="include 'labels'"):
        Trainer(model=tiny_llama(), args=args(tmp_path, steps=1), train_dataset=TRAIN, callbacks=[no_labels]).train()


# ------------------------------------------------------------------------------------------------ README snippet
def test_readme_trainer_snippet_runs(tmp_path, monkeypatch, run_card_snippet):
    """Executes the README's "In transformers' Trainer" python block verbatim, with the tiny model and data."""
    monkeypatch.chdir(tmp_path)
    namespace = run_card_snippet(README, "## In transformers' Trainer", {
        "model": tiny_llama(), "train_dataset": TRAIN, "task_batch": TASK_BATCH, "broad_batch": BROAD_BATCH})
    callback = namespace["callback"]
    assert [r["step"] for r in callback.history] == [0, 2, 4]
    assert "subspace_curvature" in callback.history[-1]
