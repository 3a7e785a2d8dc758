"""entropy_rft in TRL: ClipBGRPOTrainer through TRL's own GRPOTrainer API, offline, on a tiny Llama built from a
config with a word-level tokenizer built in memory.

Clip_B inactive (switched off, mu = inf, or a mu that clips nothing) trains bit-identically to plain
``trl.GRPOTrainer``; with Clip_B on, the keep mask equals the per-token reference loop, TRL's loss gradient equals our
own token-mean GRPO loss over the kept tokens, and the clipped tokens contribute nothing (arbitrary advantages on
them leave the gradient unchanged). Bad input (NaN / inf rewards, empty datasets, blank prompts, bad config values)
raises before any parameter changes. The README's TRL snippet is executed."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from icml26.core.testing import assert_close  # noqa: E402
from icml26.methods.entropy_rft import ClipBConfig, ClipBGRPOTrainer, grpo_loss, logprobs_and_entropy  # noqa: E402
from icml26.methods.entropy_rft import entropy_discriminator  # noqa: E402
from icml26.methods.entropy_rft.reference import clip_b_keep_reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).resolve().parents[2] / "src/icml26/methods/entropy_rft/README.md"
PROMPTS = ["1+2=", "3+4=", "5+1=", "2+2=", "7+1=", "0+9="]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character: pad 0, eos 1, digits, '+', '=', space. No download."""
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789+= ")}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   padding_side="left")


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=15, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                        pad_token_id=0, eos_token_id=1, bos_token_id=None))


def digit_sum(completions, **kwargs):
    """A reward with spread inside every group: the digit sum of the completion, scaled."""
    return [sum(int(ch) for ch in c if ch.isdigit()) / 10 for c in completions]


def _args(cls, tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                max_completion_length=3, max_steps=2, learning_rate=5e-2, report_to=[], logging_steps=1,
                save_strategy="no", use_cpu=True, bf16=False, seed=0, beta=0.0, loss_type="dapo",
                disable_tqdm=True)  # float32: the gradient comparison is exact to rounding
    return cls(**{**base, **kw})


def _train(trainer_cls, args, reward=digit_sum, prompts=PROMPTS):
    model = tiny_llama()
    trainer = trainer_cls(model=model, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tiny_tokenizer())
    trainer.train()
    return trainer, model.state_dict()


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_inactive_clip_b_trains_exactly_like_plain_grpo_trainer(tmp_path):
    """Switched off, mu = inf, and an active mu that clips nothing: bit-identical weights after 2 TRL steps."""
    _, plain = _train(GRPOTrainer, _args(GRPOConfig, tmp_path))
    for kw in (dict(clip_b=False), dict(clip_b_mu=math.inf), dict(clip_b_mu=1e9)):
        trainer, state = _train(ClipBGRPOTrainer, _args(ClipBConfig, tmp_path, **kw))
        for k in plain:
            assert torch.equal(plain[k], state[k]), (kw, k)
        assert _logged(trainer, "clip_b/frac_clipped") == [0.0, 0.0]
        assert all(math.isfinite(v) for v in _logged(trainer, "entropy_change/first_order"))
    assert any(not torch.equal(plain[k], tiny_llama().state_dict()[k]) for k in plain)  # the runs did train


class _Capture(ClipBGRPOTrainer):
    """Keeps the first micro-batch, TRL's loss gradient on it, and the gradient with the clipped tokens' advantages
    replaced by arbitrary values."""

    captured: dict | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.captured is None:
            params = [p for p in model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, params, retain_graph=True)
            keep = inputs["tool_mask"].float()
            length = inputs["completion_ids"].shape[1]
            noise = 100.0 * torch.randn(keep.shape, generator=torch.Generator().manual_seed(1))
            perturbed = dict(inputs, advantages=torch.where(keep > 0, inputs["advantages"][:, None].expand(-1, length),
                                                            noise))
            grads_perturbed = torch.autograd.grad(super().compute_loss(model, perturbed), params)
            self.captured = {"inputs": {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()},
                             "grads": grads, "grads_perturbed": grads_perturbed,
                             "state": copy.deepcopy(model.state_dict())}
        return loss


def test_clip_b_in_trl_matches_reference_and_clipped_tokens_get_zero_gradient(tmp_path):
    mu = 0.5
    args = _args(ClipBConfig, tmp_path, clip_b_mu=mu, max_steps=1)
    trainer, _ = _train(_Capture, args)
    cap = trainer.captured
    inp = cap["inputs"]  # the micro-batch is the whole generation batch (8 completions)
    model = tiny_llama()  # a plain Llama (TRL patches its own model's forward) with the pre-step weights
    model.load_state_dict(cap["state"])
    mask = inp["completion_mask"].float()
    ids = torch.cat((inp["prompt_ids"], inp["completion_ids"]), 1)
    attention = torch.cat((inp["prompt_mask"], inp["completion_mask"]), 1)
    length = inp["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -length - 1:-1] / args.temperature
    logp, entropy = logprobs_and_entropy(logits, inp["completion_ids"])
    adv = inp["advantages"][:, None].expand(-1, length) * mask

    keep = clip_b_keep_reference(entropy_discriminator(logp.detach(), entropy.detach()), adv, mask, mu)
    assert torch.equal(inp["tool_mask"].double(), keep)                    # Clip_B mask == the per-token loop
    clipped = (mask > 0) & (keep == 0)
    assert clipped.any() and bool((adv[clipped] < 0).all())               # it clipped, only negative advantages
    assert float(inp["num_items_in_batch"]) == float((mask * keep).sum())  # dapo normaliser: kept tokens
    frac = _logged(trainer, "clip_b/frac_clipped")[0]
    assert abs(frac - float(clipped.sum() / mask.sum())) < 1e-6

    params = [p for p in model.parameters() if p.requires_grad]
    ours, _ = grpo_loss(logp, logp.detach(), adv, mask * keep.float(), loss_agg_mode="token-mean")
    for name, ref, got in zip([n for n, p in model.named_parameters() if p.requires_grad],
                              torch.autograd.grad(ours, params, retain_graph=True), cap["grads"]):
        assert_close(f"TRL Clip_B grad {name}", ref, got, 1e-4, atol=1e-7)
    for ref, got in zip(cap["grads"], cap["grads_perturbed"]):             # clipped tokens contribute nothing
        assert_close("grad with arbitrary advantages on clipped tokens", ref, got, 1e-6, atol=1e-9)
    unclipped, _ = grpo_loss(logp, logp.detach(), adv, mask, loss_agg_mode="token-mean")
    diff = max(float((a - b).abs().max()) for a, b in zip(torch.autograd.grad(unclipped, params), cap["grads"]))
    assert diff > 1e-4                                                     # and the clipping mattered

    assert _logged(trainer, "clip_b/frac_clipped_pos") == [0.0]
    for key in ("entropy_discriminator/mean", "entropy_discriminator/std", "entropy_change/first_order",
                "entropy_change/first_order_unclipped"):
        assert math.isfinite(_logged(trainer, key)[0]), key


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_reward_raises_before_any_parameter_change(tmp_path, bad):
    def flaky(completions, **kwargs):
        return [bad] + [0.5] * (len(completions) - 1)

    model = tiny_llama()
    before = copy.deepcopy(model.state_dict())
    trainer = ClipBGRPOTrainer(model=model, reward_funcs=flaky, args=_args(ClipBConfig, tmp_path),
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tiny_tokenizer())
    with pytest.raises(ValueError, match="reward function 'flaky'.*non-finite"):
        trainer.train()
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k


def test_none_reward_still_means_unscored(tmp_path):
    """TRL's documented None (this function does not score the completion) is not refused."""
    def partial(completions, **kwargs):
        return [None] + digit_sum(completions)[1:]

    trainer, _ = _train(ClipBGRPOTrainer, _args(ClipBConfig, tmp_path, max_steps=1), reward=partial)
    assert trainer.state.global_step == 1


def test_empty_dataset_blank_prompt_and_wrong_args_raise(tmp_path):
    model, tok = tiny_llama(), tiny_tokenizer()
    with pytest.raises(ValueError, match="train_dataset is empty"):
        ClipBGRPOTrainer(model=model, reward_funcs=digit_sum, args=_args(ClipBConfig, tmp_path),
                         train_dataset=Dataset.from_dict({"prompt": []}), processing_class=tok)
    with pytest.raises(TypeError, match="ClipBConfig"):
        ClipBGRPOTrainer(model=model, reward_funcs=digit_sum, args=_args(GRPOConfig, tmp_path),
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok)
    before = copy.deepcopy(model.state_dict())
    trainer = ClipBGRPOTrainer(model=model, reward_funcs=digit_sum, args=_args(ClipBConfig, tmp_path),
                               train_dataset=Dataset.from_dict({"prompt": [""] * 6}), processing_class=tok)
    with pytest.raises(ValueError, match="tokenize to no tokens"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("field,value", [("clip_b_mu", -1.0), ("clip_b_mu", math.nan), ("clip_b_mu", "2.5"),
                                         ("clip_b", 1), ("log_entropy_change", "yes")])
def test_bad_clip_b_config_raises_naming_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        ClipBConfig(output_dir=str(tmp_path), **{field: value})


def test_readme_trl_snippet_runs(tmp_path, monkeypatch, run_card_snippet):
    """Executes the README's "Clip_B in TRL" python block verbatim, with the tiny model and tokenizer."""
    monkeypatch.chdir(tmp_path)
    namespace = run_card_snippet(README, "## Clip_B in TRL", {"model": tiny_llama(), "tokenizer": tiny_tokenizer()})
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2 and len(_logged(trainer, "clip_b/frac_clipped")) == 2


def test_reward_checks_cover_async_functions_and_reward_models():
    """The wrappers ClipBGRPOTrainer installs: async reward functions stay async (TRL runs them concurrently) and
    are checked; a reward model's non-finite score is caught by its forward hook."""
    import asyncio
    from types import SimpleNamespace

    from icml26.methods.entropy_rft.trl_trainer import _finite_reward_func, _finite_reward_model_hook

    async def judge(completions, **kwargs):
        return [1.0, None, math.nan]

    wrapped = _finite_reward_func(judge, "judge")
    assert asyncio.iscoroutinefunction(wrapped) and wrapped.__name__ == "judge"
    with pytest.raises(ValueError, match="reward function 'judge' returned non-finite"):
        asyncio.run(wrapped(completions=["a", "b", "c"]))
    assert _finite_reward_func(lambda completions: [None, 0.5], "ok")(["a", "b"]) == [None, 0.5]

    class RewardModel(torch.nn.Module):  # a sequence classifier's output: .logits (N, 1)
        def forward(self, scores):
            return SimpleNamespace(logits=scores[:, None])

    model = RewardModel()
    model.register_forward_hook(_finite_reward_model_hook("rm"))
    model(torch.tensor([0.5, -1.0]))
    with pytest.raises(ValueError, match="reward model 'rm' returned non-finite"):
        model(torch.tensor([0.5, math.inf]))
