"""A tiny CLIP-style dual encoder (ViT image tower + transformer text tower), its LoRA, tokenizer and pretraining.

No CLIP weights can be had offline, so this room pretrains its own stand-in with CLIP's InfoNCE on clean
compositional images (all 108 shape x colour x texture classes) and MNIST-5k digits with their prompts.

Build the cached default encoder once (about 2 minutes on 2 cores; later calls load it in milliseconds):

    python -m icml26.methods.feddtl.model          # writes ~/.cache/icml26/feddtl/dual_encoder_<hash>.safetensors
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...core.assets import cache_dir
from ...core.io import cached_tensors
from ...core.progress import progress
from .config import EncoderConfig
from .data import all_prompts, mnist_images, render_compositional, vocabulary

PAD, CLS = 0, 1


class WordTokenizer:
    """Whitespace word tokenizer over a closed vocabulary; id 0 = padding, id 1 = the [CLS] token prepended."""

    def __init__(self, words: list[str] | None = None):
        self.words = list(words if words is not None else vocabulary())
        self.index = {w: i + 2 for i, w in enumerate(self.words)}

    @property
    def vocab_size(self) -> int:
        return len(self.words) + 2

    def __call__(self, texts: list[str]) -> torch.Tensor:
        """``texts`` -> token ids ``(n, 1 + max_words)`` (CLS first, right-padded with 0)."""
        rows = []
        for t in texts:
            unknown = [w for w in t.lower().split() if w not in self.index]
            if unknown:
                raise ValueError(f"words {unknown} of prompt {t!r} are not in the tokenizer's vocabulary")
            rows.append([CLS] + [self.index[w] for w in t.lower().split()])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [PAD] * (width - len(r)) for r in rows], dtype=torch.long)


class LoRALinear(nn.Module):
    """``y = W0 x + b + (alpha / r) B A x`` with frozen ``W0, b``; ``A`` (r, in) random, ``B`` (out, r) zero."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)


class Block(nn.Module):
    """Pre-LN transformer block with explicit Linear layers (so LoRA can wrap ``qkv``, ``proj``, ``fc1``, ``fc2``)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = None if pad_mask is None else (~pad_mask)[:, None, None, :]  # True = attend
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class VisionTower(nn.Module):
    """ViT: patches -> [CLS] + tokens -> blocks -> LN([CLS]) -> projection. Output ``(n, embed_dim)``, unnormalised."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.patch = cfg.patch
        n_tokens = (cfg.image_size // cfg.patch) ** 2
        self.embed = nn.Linear(3 * cfg.patch ** 2, cfg.width)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.pos = nn.Parameter(torch.randn(1, n_tokens + 1, cfg.width) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads) for _ in range(cfg.vision_layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.embed_dim, bias=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.patch
        n = images.shape[0]
        x = F.unfold(images, kernel_size=p, stride=p).transpose(1, 2)          # (n, tokens, 3 p p)
        x = torch.cat([self.cls.expand(n, -1, -1), self.embed(x)], 1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x[:, 0]))


class TextTower(nn.Module):
    """Word embeddings + positions -> bidirectional blocks (padding masked) -> LN([CLS]) -> projection."""

    def __init__(self, cfg: EncoderConfig, vocab_size: int, max_len: int = 12):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, cfg.width)
        self.pos = nn.Parameter(torch.randn(1, max_len, cfg.width) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads) for _ in range(cfg.text_layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.embed_dim, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.forward_embedded(self.tok(ids), ids == PAD)

    def forward_embedded(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``x`` (n, L, width) with padding mask ``pad`` (n, L) -> ``(n, embed_dim)`` (used by
        prompt learning, whose context vectors are not words)."""
        x = x + self.pos[:, : x.shape[1]]
        for block in self.blocks:
            x = block(x, pad)
        return self.head(self.ln(x[:, 0]))


class DualEncoder(nn.Module):
    """CLIP-style model: ``logits = exp(logit_scale) * norm(V(x)) @ norm(T(prompts)).T`` (tau = exp(-logit_scale))."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = WordTokenizer()
        self.vision = VisionTower(cfg)
        self.text = TextTower(cfg, self.tokenizer.vocab_size)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """``(n, 3, S, S)`` -> unit-norm class-token embeddings ``(n, embed_dim)`` (z̄_v)."""
        return F.normalize(self.vision(images), dim=-1)

    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """prompts -> unit-norm text embeddings ``(C, embed_dim)`` (z̄_text)."""
        ids = self.tokenizer(prompts).to(self.logit_scale.device)
        return F.normalize(self.text(ids), dim=-1)

    @property
    def scale(self) -> torch.Tensor:
        """1/tau, clamped at 100 as in CLIP."""
        return self.logit_scale.exp().clamp(max=100.0)


def add_lora(tower: nn.Module, from_layer: int, rank: int, alpha: float,
             targets: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")) -> list[str]:
    """Wrap ``targets`` Linears of blocks ``from_layer..`` of ``tower`` with :class:`LoRALinear` (in place).

    Returns the names of the new LoRA parameters (relative to ``tower``). Raises if ``from_layer`` is out of range.
    """
    depth = len(tower.blocks)
    if not 0 <= from_layer < depth:
        raise ValueError(f"from_layer must be in [0, {depth}), got {from_layer}")
    for i in range(from_layer, depth):
        block = tower.blocks[i]
        for name in targets:
            layer = getattr(block, name)
            if isinstance(layer, LoRALinear):
                raise ValueError(f"block {i}.{name} already has LoRA")
            setattr(block, name, LoRALinear(layer, rank, alpha))
    return [n for n, _ in tower.named_parameters() if "lora_" in n]


def lora_state(tower: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the LoRA parameters of ``tower`` by name (the tensors clients upload)."""
    return {n: p.detach().clone() for n, p in tower.named_parameters() if "lora_" in n}


def load_lora(tower: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into the LoRA parameters of ``tower``; names and shapes must match exactly."""
    params = {n: p for n, p in tower.named_parameters() if "lora_" in n}
    if set(params) != set(state):
        raise ValueError(f"LoRA names differ: missing {sorted(set(params) - set(state))}, "
                         f"unexpected {sorted(set(state) - set(params))}")
    with torch.no_grad():
        for n, p in params.items():
            if p.shape != state[n].shape:
                raise ValueError(f"LoRA {n}: shape {tuple(state[n].shape)} != {tuple(p.shape)}")
            p.copy_(state[n])


def pretraining_set(cfg: EncoderConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean compositional images (``per_class`` per class, labels 0..107) plus MNIST-5k (labels 108..117)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(108).repeat_interleave(cfg.per_class)
    images = render_compositional(labels, size=cfg.image_size, style="clean", generator=g)
    if cfg.use_mnist:
        mx, my = mnist_images(cfg.image_size)
        images, labels = torch.cat([images, mx]), torch.cat([labels, my + 108])
    return images, labels


def clip_loss(model: DualEncoder, images: torch.Tensor, labels: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE with class prompts: image->text CE over all prompts, plus text->image over the batch
    where every image of the prompt's class is a positive (mean log-likelihood of the positives)."""
    z = model.encode_image(images)
    logits = model.scale * z @ text_emb.T                         # (n, C)
    i2t = F.cross_entropy(logits, labels)
    present = labels.unique()
    t_logits = logits[:, present].T                               # (c_present, n)
    positives = (labels[None, :] == present[:, None]).float()
    t2i = -(t_logits.log_softmax(-1) * positives).sum(-1).div(positives.sum(-1)).mean()
    return 0.5 * (i2t + t2i)


def pretrain(cfg: EncoderConfig, seed: int = 0, device: str | torch.device | None = None) -> DualEncoder:
    """Pretrain a :class:`DualEncoder` from scratch with InfoNCE (AdamW, cosine decay, light augmentation)."""
    torch.manual_seed(seed)
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = DualEncoder(cfg).to(device)
    images, labels = pretraining_set(cfg, seed)
    images, labels = images.to(device), labels.to(device)
    prompts = all_prompts()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
    g = torch.Generator(device="cpu").manual_seed(seed)
    for _ in progress(range(cfg.steps), desc="pretraining dual encoder"):
        idx = torch.randint(0, len(images), (cfg.batch_size,), generator=g).to(device)
        x = images[idx]
        # augmentation: brightness jitter and a little pixel noise, so the tower is not brittle to the shift
        x = (x * (0.8 + 0.4 * torch.rand(len(x), 1, 1, 1, generator=g).to(device))
             + 0.05 * torch.randn(x.shape, generator=g).to(device)).clamp(0, 1)
        loss = clip_loss(model, x, labels[idx], model.encode_text(prompts))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model.eval()


def _cache_path(cfg: EncoderConfig, seed: int):
    key = hashlib.sha256(json.dumps({**asdict(cfg), "seed": seed, "v": 1}, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir("feddtl") / f"dual_encoder_{key}.safetensors"


def load_pretrained(cfg: EncoderConfig | None = None, seed: int = 0,
                    device: str | torch.device | None = None) -> DualEncoder:
    """The pretrained dual encoder for ``cfg`` (default: :class:`EncoderConfig`), built once and cached."""
    cfg = cfg or EncoderConfig()
    tensors = cached_tensors(_cache_path(cfg, seed), lambda: pretrain(cfg, seed).state_dict())
    model = DualEncoder(cfg)
    model.load_state_dict(tensors)
    return model.to(device if device is not None else "cpu").eval()


@torch.no_grad()
def zero_shot_accuracy(model: DualEncoder, images: torch.Tensor, labels: torch.Tensor, prompts: list[str]) -> float:
    """Accuracy of ``argmax_c sim(z̄_v, z̄_text^c)`` with ``labels`` indexing ``prompts``."""
    dev = model.logit_scale.device
    pred = (model.encode_image(images.to(dev)) @ model.encode_text(prompts).T).argmax(-1)
    return float((pred.cpu() == labels).float().mean())


if __name__ == "__main__":  # documented build command
    import time

    torch.set_num_threads(2)
    t0 = time.time()
    cfg = EncoderConfig()
    path = _cache_path(cfg, 0)
    model = load_pretrained(cfg)
    print(f"dual encoder at {path} ({sum(p.numel() for p in model.parameters())} params, {time.time() - t0:.1f} s)")
    g = torch.Generator().manual_seed(123)
    lab = torch.arange(108).repeat_interleave(5)
    names = all_prompts()[:108]
    for style in ("clean", "shifted"):
        x = render_compositional(lab, style=style, generator=g)
        print(f"zero-shot 108-way accuracy, {style}: {zero_shot_accuracy(model, x, lab, names):.3f}")
    from .data import digit_prompt, sklearn_digits_images
    dx, dy = sklearn_digits_images()
    print(f"zero-shot sklearn digits: {zero_shot_accuracy(model, dx, dy, [digit_prompt(d) for d in range(10)]):.3f}")
