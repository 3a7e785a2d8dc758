"""CalM options. No official code is public (arXiv 2604.04958 v2: "code will be released soon"), so every field is
a reconstruction from the abstract and the room notes; its help says what it is anchored on."""

from __future__ import annotations

from dataclasses import dataclass, field

TOKENIZERS = ("vqvae", "fsq", "rvq", "kmeans", "continuous")
NEURAL_AXES = ("bidirectional", "raster", "none")


@dataclass
class CalMConfig:
    """Tokenizer + dual-axis autoregressive transformer. Tokens are X[n, t]: neuron n, patch t of P frames.

    ``neural_axis="none"`` drops the across-neuron attention (a time-only, per-neuron model: the ablation);
    ``neural_axis="raster"`` lets (n, t) also read X[n', t+1] for n' < n (reading (ii));
    ``tokenizer="continuous"`` embeds patches linearly and regresses the next patch (the no-VQ ablation).
    Pretraining is the trainer's job; a model with zero pretraining steps is the from-scratch baseline.
    """

    patch_len: int = field(default=8, metadata={
        "help": "P, frames per token (RECON: notes 5.2 suggest 8-16; 8 at 10 Hz = 0.8 s)"})
    codebook_size: int = field(default=64, metadata={
        "help": "K, shared vocabulary size (RECON: notes suggest 256-1024; 64 at laptop scale)"})
    tokenizer: str = field(default="vqvae", metadata={
        "help": "abstract: single-neuron traces mapped into a shared discrete vocabulary. 'vqvae' (RECON, notes 5.2: "
                "MLP encoder/decoder, EMA codebook, commitment 0.25), 'fsq' (finite scalar quantisation, K = prod "
                "of levels), 'rvq' (RECON, notes 5.2: residual VQ, ``rvq_stages`` EMA codebooks of K^(1/stages) "
                "codes, the token indexes their combination), 'kmeans' (v1/v2: k-means codebook over z-scored "
                "patches) or "
                "'continuous' (ablation: linear patch embedding, MSE next-patch objective)"})
    rvq_stages: int = field(default=2, metadata={
        "help": "residual stages of tokenizer='rvq' (ours; SoundStream-style); codebook_size must be k**rvq_stages"})
    d_model: int = field(default=32, metadata={"help": "d, width (RECON: notes 5.5 use 64; 32 at laptop scale)"})
    n_blocks: int = field(default=2, metadata={
        "help": "number of dual-axis blocks, each = temporal causal attention + neural-axis attention + MLP "
                "(RECON: notes 5.5, 2 temporal + 2 neural)"})
    n_heads: int = field(default=4, metadata={"help": "attention heads (RECON: notes 5.5)"})
    neural_axis: str = field(default="bidirectional", metadata={
        "help": "'bidirectional': attention over all neurons at the same patch index, which only ever sees "
                "causal-in-time states, so it is leak-free (RECON, notes reading (i)); 'raster': also the next "
                "tokens of neurons earlier in a fixed order (notes reading (ii)); 'none': time-only ablation"})
    max_patches: int = field(default=16, metadata={"help": "length of the learned temporal position table (ours)"})

    def __post_init__(self) -> None:
        for name in ("patch_len", "codebook_size", "d_model", "n_blocks", "n_heads", "max_patches", "rvq_stages"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.codebook_size < 2:
            raise ValueError(f"codebook_size must be at least 2, got {self.codebook_size!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if self.tokenizer == "rvq":
            k = round(self.codebook_size ** (1 / self.rvq_stages))
            if k < 2 or k ** self.rvq_stages != self.codebook_size:
                raise ValueError(f"tokenizer='rvq' needs codebook_size = k**rvq_stages with k >= 2; got codebook_size="
                                 f"{self.codebook_size}, rvq_stages={self.rvq_stages}")
        if self.neural_axis not in NEURAL_AXES:
            raise ValueError(f"neural_axis must be one of {NEURAL_AXES}, got {self.neural_axis!r}")
