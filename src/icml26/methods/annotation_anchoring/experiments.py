"""Laptop-scale check of arXiv 2605.09995 with a byte-level TinyLM on a synthetic topic corpus.

Corpus (the notes' Sec. 9.2 design): K = 20 topics, each with its own lexicon of 6 three-letter words (disjoint,
fixed by split seed 0). A document is 5 words drawn uniformly from one topic's lexicon; topics are uniform in
pretraining, so the pretraining topic entropy is log 20. The annotation of a document is ``#X:`` with X the topic
letter (A..T). Byte sequences:

* plain pretraining      ``BOS doc \\n``               anchored pretraining  ``BOS #X: doc \\n`` (all tokens trained)
* plain SFT              ``BOS Q> <doc>``              anchored SFT          ``BOS Q> #X: <doc>`` (loss on ``<doc>``)

The SFT set is narrow, "high-quality formatted" answers from topics A and B only. Every arm samples 500
responses to the prompt ``BOS Q>``; a fixed lexicon classifier (majority topic of the lexicon words) labels each
one. Diversity = entropy of those labels; quality = format adherence (``<`` + 5 three-letter words + ``>``).

Arms (same model size, pretraining steps, SFT steps, batch size and learning rates; no tuning):
``anchored`` (annotated pretraining, annotation-masked SFT, annotation sampled first), ``sft`` (the paper's
baseline), ``sft_temp`` (``sft`` sampled at temperature 1.2: the "diverse prompting" baseline of the notes),
``anchored_unmasked`` (ablation: annotated, but SFT also trains the annotation tokens).

Specs: ``diversity_collapse`` (pre-registered; annotation after the prompt, as in the paper's a ~ p(a | prompt))
and ``diversity_collapse_prefix`` (post hoc, added after the first was not reproduced: the annotation, carrying the
BOS, goes before the prompt, ``BOS #X: Q> <doc>``, so a is sampled in exactly its pretraining context).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ...core.logging import log_metrics
from ...core.seeding import seed_everything
from ...harness.spec import Comparator, ExperimentSpec
from .config import AnnotationAnchoringConfig
from .metrics import category_entropy, coverage, distinct_n, gap_closed, kl_to_reference
from .trainer import AnchoredSFTTrainer, AnnotatedExample

N_TOPICS, WORDS_PER_TOPIC, WORD_LEN, DOC_WORDS = 20, 6, 3, 5
BOS, PROMPT = "\x02", "Q>"
ARMS = ("anchored", "sft", "sft_temp", "anchored_unmasked")


class TopicCorpus:
    """K topics with disjoint lexicons; ``classify`` is the fixed topic classifier of the claim."""

    def __init__(self, n_topics: int = N_TOPICS, split_seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(split_seed)
        words: list[str] = []
        seen: set[str] = set()
        while len(words) < n_topics * WORDS_PER_TOPIC:
            w = "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (WORD_LEN,), generator=gen))
            if w not in seen:
                seen.add(w)
                words.append(w)
        self.n_topics = n_topics
        self.lexicons = [words[k * WORDS_PER_TOPIC:(k + 1) * WORDS_PER_TOPIC] for k in range(n_topics)]
        self.topic_of = {w: k for k, lex in enumerate(self.lexicons) for w in lex}

    @staticmethod
    def annotation(topic: int) -> str:
        return f"#{chr(65 + topic)}:"

    def document(self, topic: int, gen: torch.Generator) -> str:
        idx = torch.randint(0, WORDS_PER_TOPIC, (DOC_WORDS,), generator=gen)
        return " ".join(self.lexicons[topic][int(i)] for i in idx)

    def classify(self, text: str) -> int | None:
        """Majority topic of the lexicon words in ``text`` (ties -> smallest topic id); None if it has none."""
        votes = [0] * self.n_topics
        for w in text.replace("<", " ").replace(">", " ").split():
            if w in self.topic_of:
                votes[self.topic_of[w]] += 1
        best = max(range(self.n_topics), key=lambda k: (votes[k], -k))
        return best if votes[best] > 0 else None

    @staticmethod
    def well_formed(response: str) -> bool:
        """Format adherence (the quality metric): ``<`` + exactly DOC_WORDS space-separated lowercase words of
        WORD_LEN letters + ``>``, the answer format SFT teaches; the words' topic is not judged here."""
        if not (response.startswith("<") and ">" in response):
            return False
        words = response[1:response.index(">")].split(" ")
        return len(words) == DOC_WORDS and all(len(w) == WORD_LEN and w.isalpha() and w.islower() for w in words)

    def on_lexicon(self, response: str) -> bool:
        """Well formed and every word from the lexicon of a single topic (knowledge of the topic, not format)."""
        if not self.well_formed(response):
            return False
        topics = {self.topic_of.get(w, -1) for w in response[1:response.index(">")].split(" ")}
        return len(topics) == 1 and -1 not in topics


def _enc(text: str) -> list[int]:
    return list(text.encode("latin-1"))


def pretrain_example(corpus: TopicCorpus, annotated: bool, gen: torch.Generator) -> AnnotatedExample:
    topic = int(torch.randint(0, corpus.n_topics, (1,), generator=gen))
    return AnnotatedExample(_enc(BOS), _enc(corpus.annotation(topic)) if annotated else [],
                            _enc(corpus.document(topic, gen) + "\n"))


def sft_example(corpus: TopicCorpus, topics: list[int], gen: torch.Generator,
                before_prompt: bool = False) -> AnnotatedExample:
    """``BOS Q> [#X:] <doc>``; with ``before_prompt`` the annotation carries the BOS: ``BOS #X: Q> <doc>``."""
    topic = topics[int(torch.randint(0, len(topics), (1,), generator=gen))]
    response = _enc("<" + corpus.document(topic, gen) + ">")
    if before_prompt:
        return AnnotatedExample(_enc(PROMPT), _enc(BOS + corpus.annotation(topic)), response)
    return AnnotatedExample(_enc(BOS + PROMPT), _enc(corpus.annotation(topic)), response)


def _model(config: Mapping[str, Any]):
    from ...models.tiny_lm import TinyLM, TinyLMConfig

    return TinyLM(TinyLMConfig(vocab_size=256, d_model=config["d_model"], n_layers=config["n_layers"],
                               n_heads=config["n_heads"], max_seq_len=48))


def _train(trainer: AnchoredSFTTrainer, make, steps: int, batch: int, gen: torch.Generator) -> float:
    loss = math.nan
    for _ in range(steps):
        loss = trainer.step([make(gen) for _ in range(batch)])["loss"]
    return loss


_PRETRAINED: dict[tuple, tuple[dict, float]] = {}
"""In-process memo of pretrained bases: the two specs share their pretraining runs (same config and seed) within
one process, so ``make reproduce`` pretrains each base once. Nothing is stored on disk."""
_PRETRAIN_KEYS = ("d_model", "n_layers", "n_heads", "batch_size", "pretrain_lr", "pretrain_steps")


def pretrained_base(config: Mapping[str, Any], seed: int, annotated: bool, corpus: TopicCorpus) -> tuple[dict, float]:
    """(state_dict copy, final pretraining loss) of :func:`pretrain`, memoised per process."""
    key = (tuple(config[k] for k in _PRETRAIN_KEYS), seed, annotated)
    if key not in _PRETRAINED:
        model, loss = pretrain(config, seed, annotated, corpus)
        _PRETRAINED[key] = ({k: v.clone() for k, v in model.state_dict().items()}, loss)
    return _PRETRAINED[key]


def pretrain(config: Mapping[str, Any], seed: int, annotated: bool, corpus: TopicCorpus):
    """Pretrain a TinyLM on the uniform-topic corpus (annotated: every token, annotation included, is trained)."""
    seed_everything(seed)
    model = _model(config)
    cfg = AnnotationAnchoringConfig(use_annotations=annotated, mask_annotation_loss=False)
    trainer = AnchoredSFTTrainer(model, torch.optim.Adam(model.parameters(), lr=config["pretrain_lr"]), cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    loss = _train(trainer, lambda g: pretrain_example(corpus, annotated, g), config["pretrain_steps"],
                  config["batch_size"], gen)
    return model, loss


def evaluate(trainer: AnchoredSFTTrainer, corpus: TopicCorpus, n: int) -> dict:
    before = trainer.config.use_annotations and trainer.config.annotation_position == "before_prompt"
    prompt = torch.tensor([_enc(PROMPT if before else BOS + PROMPT)])
    annotations, responses = trainer.sample(prompt, n)
    texts = [bytes(r.tolist()).decode("latin-1") for r in responses]
    labels = [corpus.classify(t[:t.index(">")] if ">" in t else t) for t in texts]
    uniform = {k: 1.0 / corpus.n_topics for k in range(corpus.n_topics)}
    out = {"topic_entropy": category_entropy(labels),
           "format_adherence": sum(corpus.well_formed(t) for t in texts) / n,
           "on_lexicon": sum(corpus.on_lexicon(t) for t in texts) / n,
           "coverage": coverage(labels, list(range(corpus.n_topics))),
           "kl_to_pretrain": kl_to_reference(labels, uniform),
           "frac_classified": sum(x is not None for x in labels) / n,
           "distinct_2_words": distinct_n([t.split(">")[0].lstrip("<").split() for t in texts], 2)}
    if trainer.config.use_annotations:
        ann = [bytes(a.tolist()).decode("latin-1").lstrip(BOS) for a in annotations]
        match = [lab is not None and a == corpus.annotation(lab) for a, lab in zip(ann, labels)]
        out["annotation_followed"] = sum(match) / n
        out["annotation_entropy"] = category_entropy(ann)
    return out


def run_seed(config: Mapping[str, Any], seed: int, prepared: Any) -> dict:
    torch.set_num_threads(1)
    corpus = TopicCorpus()
    sft_topics = list(range(config["sft_topics"]))
    h_ref = math.log(corpus.n_topics)
    arms: dict[str, dict] = {}
    bases = {annotated: pretrained_base(config, seed, annotated, corpus) for annotated in (False, True)}
    position = config.get("annotation_position", "after_prompt")
    before = position == "before_prompt"
    runs = {"anchored": (True, True, 1.0), "sft": (False, True, 1.0), "sft_temp": (False, True, config["temp_high"]),
            "anchored_unmasked": (True, False, 1.0)}
    for arm in ARMS:
        annotated, masked, temp = runs[arm]
        seed_everything(seed)
        model = _model(config)
        model.load_state_dict(bases[annotated][0])
        cfg = AnnotationAnchoringConfig(
            use_annotations=annotated, mask_annotation_loss=masked, annotation_position=position,
            annotation_start_ids=tuple(_enc(BOS + "#" if before else "#")),
            annotation_end_id=_enc(":")[0], max_annotation_tokens=3, temperature=temp,
            max_new_tokens=2 + DOC_WORDS * (WORD_LEN + 1))
        trainer = AnchoredSFTTrainer(model, torch.optim.Adam(model.parameters(), lr=config["sft_lr"]), cfg,
                                     generator=torch.Generator().manual_seed(seed + 2))
        gen = torch.Generator().manual_seed(seed + 3)  # the same SFT examples, in the same order, for every arm
        sft_loss = _train(trainer, lambda g: sft_example(corpus, sft_topics, g, before and annotated),
                          config["sft_steps"],
                          config["batch_size"], gen)
        ev = evaluate(trainer, corpus, config["n_samples"])
        arms[arm] = {**ev, "collapse": h_ref - ev["topic_entropy"], "sft_loss": sft_loss,
                     "pretrain_loss": bases[annotated][1]}
        log_metrics(seed, arm=arm, **{k: v for k, v in arms[arm].items() if isinstance(v, float)})
    a, s = arms["anchored"], arms["sft"]
    closed = gap_closed(a["topic_entropy"], s["topic_entropy"], h_ref)
    quality_ok = a["format_adherence"] >= s["format_adherence"] - config["quality_tolerance"]
    stats = {"gap_closed_quality_gated": closed if quality_ok else 0.0, "gap_closed": closed,
             "format_adherence_gap": a["format_adherence"] - s["format_adherence"],
             "collapse_ratio": s["collapse"] / max(a["collapse"], 1e-6),
             "gap_closed_sft_temp": gap_closed(arms["sft_temp"]["topic_entropy"], s["topic_entropy"], h_ref),
             "gap_closed_unmasked": gap_closed(arms["anchored_unmasked"]["topic_entropy"], s["topic_entropy"], h_ref)}
    return {"arms": arms, "statistics": stats}


def plot_entropy(result: dict, ax) -> None:
    """Topic entropy vs format adherence per arm and seed; the dotted line is log K (pretraining)."""
    for arm in result["arms_order"]:
        xs = [r["arms"][arm]["format_adherence"] for r in result["seed_results"] if arm in r["arms"]]
        ys = [r["arms"][arm]["topic_entropy"] for r in result["seed_results"] if arm in r["arms"]]
        ax.scatter(xs, ys, label=arm)
    ax.axhline(math.log(N_TOPICS), color="k", ls=":", lw=1, label="pretraining (log 20)")
    ax.set_xlabel("format adherence (quality)")
    ax.set_ylabel("topic entropy of 500 samples (nats)")
    ax.legend(fontsize=8)


COMPARATOR = Comparator(
    "gap_closed_quality_gated", ">=", 0.5,
    "(H_anchored - H_sft) / (log 20 - H_sft) >= 0.5, where H is the topic entropy of the samples; set to 0 when "
    "the anchored arm's format adherence is more than 0.1 below plain SFT's (diversity must not cost quality). "
    "The paper reports ~85% of the gap closed; 0.5 is the laptop-scale bar")


def _tier(pretrain_steps: int, sft_steps: int, n_samples: int, **kw: Any) -> dict:
    return {"d_model": 64, "n_layers": 2, "n_heads": 4, "batch_size": 32, "pretrain_lr": 3e-3, "sft_lr": 1e-3,
            "pretrain_steps": pretrain_steps, "sft_steps": sft_steps, "n_samples": n_samples, "sft_topics": 2,
            "temp_high": 1.2, "quality_tolerance": 0.1, **kw}


SPECS = [
    ExperimentSpec(
        id="diversity_collapse", room="annotation_anchoring",
        claim="Annotation-anchored post-training (annotation loss masked, annotation sampled first) keeps most of "
              "the pretrained semantic diversity that plain SFT collapses, at similar instruction-following quality",
        paper_ref="arXiv 2605.09995, abstract and Sec. 1 ('closes ~85% of the semantic-diversity gap', "
                  "'6x less diversity collapse than SFT')",
        metric="entropy of the topic distribution of 500 samples (fixed lexicon classifier) and format adherence",
        arms=ARMS, baseline="sft", comparator=COMPARATOR, run=run_seed, plot=plot_entropy,
        tiers={"smoke": _tier(10, 5, 40), "quick": _tier(1500, 300, 500), "full": _tier(4000, 600, 2000)},
        seeds={"smoke": 1, "quick": 3, "full": 5},
        notes="Synthetic 20-topic byte corpus, TinyLM d=64 x 2 layers; SFT on topics A/B only. The paper uses LLM "
              "annotations of real pretraining documents and instruction-tuned models of several sizes.",
    ),
    ExperimentSpec(
        id="diversity_collapse_prefix", room="annotation_anchoring",
        claim="As diversity_collapse, with the annotation placed before the prompt (a ~ p(a) in its pretraining "
              "context) instead of after it",
        paper_ref="arXiv 2605.09995, abstract and Sec. 1; placement is a reconstructed option",
        metric="entropy of the topic distribution of 500 samples (fixed lexicon classifier) and format adherence",
        arms=ARMS, baseline="sft", comparator=COMPARATOR, run=run_seed, plot=plot_entropy,
        tiers={t: {**c, "annotation_position": "before_prompt"} for t, c in
               (("smoke", _tier(10, 5, 40)), ("quick", _tier(1500, 300, 500)), ("full", _tier(4000, 600, 2000)))},
        seeds={"smoke": 1, "quick": 3, "full": 5},
        notes="POST-HOC: designed after diversity_collapse was not reproduced, because its sampled annotations "
              "followed a prompt never seen in pretraining and came out malformed. Same config, seeds and "
              "comparator otherwise; the plain arms are identical to diversity_collapse. Exploratory, not "
              "confirmatory.",
    ),
]
