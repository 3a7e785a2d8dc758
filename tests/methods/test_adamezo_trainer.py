"""ZOTrainer: MeZO and AdaMeZO inside transformers' Trainer (its own API: train, evaluate, checkpoint, resume)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from icml26.methods.adamezo import AdaMeZO, zo_param_groups  # noqa: E402
from icml26.methods.adamezo.trainer import ZOTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n=12, length=8, vocab=40, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=1e-3, max_steps=6,
                lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], seed=0,
                use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**base, **kw})


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_trainer_step_equals_a_plain_adamezo_loop(tmp_path):
    batches = []

    class Recording(ZOTrainer):  # keeps the batches Trainer fed, to replay them in a plain loop
        def training_step(self, model, inputs, num_items_in_batch=None):
            batches.append({k: v.clone() for k, v in inputs.items()})
            return super().training_step(model, inputs, num_items_in_batch)

    model = _model()
    trainer = Recording(model=model, args=_args(tmp_path, max_steps=5), train_dataset=_Rows(),
                        zo_kwargs={"eps": 1e-3, "window": 2, "seed": 3})
    trainer.train()

    plain = _model()
    opt = AdaMeZO(zo_param_groups(plain, 0.0), lr=1e-3, eps=1e-3, window=2, seed=3)
    plain.eval()
    for batch in batches:
        opt.step(lambda: plain(**batch).loss)
    for name, value in _params(plain).items():
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), value, rtol=0, atol=1e-6)
    assert trainer.optimizer.optimizer.forward_passes == 10
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 5 and all(torch.isfinite(torch.tensor(logged)))


def test_user_optimizer_instance_and_evaluate(tmp_path):
    model = _model()
    opt = AdaMeZO(model.parameters(), lr=1e-3, window=3)
    trainer = ZOTrainer(model=model, args=_args(tmp_path, max_steps=3), train_dataset=_Rows(),
                        eval_dataset=_Rows(n=4, seed=1), optimizers=(opt, None))
    trainer.train()
    assert opt.forward_passes == 6 and "eval_loss" in trainer.evaluate()


def test_resume_from_checkpoint_is_exact(tmp_path):
    straight = _model()
    ZOTrainer(model=straight, args=_args(tmp_path / "a", max_steps=6), train_dataset=_Rows(),
              zo_kwargs={"window": 2}).train()
    first = _model()
    ZOTrainer(model=first, args=_args(tmp_path / "b", max_steps=6, save_strategy="steps", save_steps=3),
              train_dataset=_Rows(), zo_kwargs={"window": 2}).train()
    resumed = _model()
    trainer = ZOTrainer(model=resumed, args=_args(tmp_path / "b", max_steps=6), train_dataset=_Rows(),
                        zo_kwargs={"window": 2})
    trainer.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-3"))
    assert trainer.optimizer.optimizer.state["zo"]["step"] == 6
    for name, value in _params(straight).items():
        torch.testing.assert_close(dict(resumed.named_parameters())[name].detach(), value, rtol=0, atol=1e-6)


def test_bad_setups_are_refused(tmp_path):
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        ZOTrainer(model=_model(), args=_args(tmp_path, gradient_accumulation_steps=2), train_dataset=_Rows())
    with pytest.raises(ValueError, match="zo_optimizer"):
        ZOTrainer(model=_model(), args=_args(tmp_path), train_dataset=_Rows(), zo_optimizer="sgd")
    model = _model()
    with pytest.raises(TypeError, match="MeZO or AdaMeZO"):
        ZOTrainer(model=model, args=_args(tmp_path), train_dataset=_Rows(),
                  optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
