"""FedDTL room: the feature-shift split, its styles, the domain-separability check and the partition/regime specs."""

from __future__ import annotations

import pytest
import torch

from icml26.methods.feddtl.data import (FEATURE_STYLES, domain_separability, label_skew, make_task,
                                        render_compositional)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_feature_styles_are_distinct_deterministic_and_in_range():
    lab = torch.arange(0, 108, 7)
    imgs = {}
    for style in FEATURE_STYLES:
        a = render_compositional(lab, style=style, generator=torch.Generator().manual_seed(3))
        b = render_compositional(lab, style=style, generator=torch.Generator().manual_seed(3))
        assert a.shape == (len(lab), 3, 16, 16) and torch.equal(a, b) and a.min() >= 0 and a.max() <= 1
        imgs[style] = a
    # "clutter" is the quick tier's "shifted" domain bit for bit; every other style differs from it
    shifted = render_compositional(lab, style="shifted", generator=torch.Generator().manual_seed(3))
    assert torch.equal(imgs["clutter"], shifted)
    for style in FEATURE_STYLES[1:]:
        assert (imgs[style] - shifted).abs().mean() > 0.01, style
    with pytest.raises(ValueError, match="style must be one of"):
        render_compositional(lab, style="sepia")


def test_feature_shift_task_gives_every_client_every_class_in_its_own_style():
    task = make_task(4, n_base=4, n_novel=3, num_clients=3, train_per_class=7, val_per_class=3, test_per_class=6,
                     split="feature_shift")
    counts = torch.stack([torch.bincount(y, minlength=4) for y in task.client_y])        # (clients, classes)
    assert counts.sum().item() == 4 * 7 and (counts.sum(0) == 7).all()
    assert counts.max() - counts.min() <= 1 and label_skew(task) < 0.1                  # IID labels
    assert task.test_base_x.shape == (24, 3, 16, 16) and (task.test_novel_y >= 4).all()
    # deterministic per seed, different across seeds
    again = make_task(4, n_base=4, n_novel=3, num_clients=3, train_per_class=7, val_per_class=3, test_per_class=6,
                      split="feature_shift")
    assert all(torch.equal(a, b) for a, b in zip(task.client_x, again.client_x))
    # style of a client shows in its pixels: the "noise" client (k = 1) has the largest pixel-to-pixel jitter
    jitter = [float((x[..., 1:] - x[..., :-1]).abs().mean()) for x in task.client_x]
    assert max(range(3), key=jitter.__getitem__) == FEATURE_STYLES.index("noise")


def test_feature_shift_rejects_too_few_images_before_rendering():
    with pytest.raises(ValueError, match="train_per_class"):
        make_task(0, num_clients=5, train_per_class=4, split="feature_shift")
    with pytest.raises(ValueError, match="split must be one of"):
        make_task(0, split="style")


def test_domain_separability_by_hand():
    # two clients whose rows sit at +-1: every held-out row is named correctly -> accuracy 1 = 2x chance
    a, b = torch.full((4, 2), 1.0), torch.full((4, 2), -1.0)
    assert domain_separability([a, b]) == pytest.approx(2.0)
    # identical clients: ties go to the first centroid, so client 0's odd rows are right and client 1's wrong
    assert domain_separability([a, a.clone()]) == pytest.approx(1.0)
    # hand-computed mixed case: centroids from even rows (0, 0) and (1, 0); odd rows (0.9, 0) of client 0 is
    # nearer client 1 (wrong), (0.1, 0) right; client 1's odd rows (1, 0) right, (1, 0) right -> 3/4 * 2 = 1.5
    c0 = torch.tensor([[0.0, 0.0], [0.9, 0.0], [0.0, 0.0], [0.1, 0.0]])
    c1 = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    assert domain_separability([c0, c1]) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        domain_separability([a])


def test_regime_specs_declare_their_change_and_reject_the_null_arm():
    from icml26.methods.feddtl import experiments as ex
    regimes = {s.id: s for s in ex.SPECS if s.id.startswith("hm_gain_")}
    assert set(regimes) == set(ex.REGIMES)
    for spec_id, spec in regimes.items():
        assert set(spec.tiers) == {"smoke", "full"} and spec.seeds["full"] == 5
        assert not spec.comparator.holds(spec.null_value) and spec.comparator.statistic == "hm_gain"
        full = spec.tiers["full"]
        changed = {k for k in full if full[k] != ex._REGIME_BASE.get(k)}
        assert changed == set(ex.REGIMES[spec_id][0]), spec_id          # one setting changed, nothing else
    names = {c.name for c in regimes["hm_gain_feature_shift"].checks}
    assert "domain_separability" in names and "label_skew" not in names
    for spec_id, alpha in (("hm_gain_dirichlet_0p5", 0.5), ("hm_gain_dirichlet_1", 1.0)):
        assert regimes[spec_id].tiers["full"]["alpha"] == alpha and regimes[spec_id].tiers["smoke"]["alpha"] == alpha
        skew = [c for c in regimes[spec_id].checks if c.name == "label_skew"]
        assert len(skew) == 1 and skew[0].threshold == 0.15
        assert len(regimes[spec_id].checks) == len(ex._CHECKS)
    # the registered quick tier is untouched by the optional keys
    assert not set(ex._OPTIONAL_TASK_KEYS + ex._OPTIONAL_FED_KEYS) & set(ex.TIERS["quick"])


@pytest.mark.slow  # ~40 s loaded; tests/claims/test_smoke_specs.py also runs every spec at smoke
def test_feature_shift_spec_runs_at_smoke(tmp_path):
    from icml26.harness.runner import run_spec
    from icml26.methods.feddtl import experiments as ex
    spec = next(s for s in ex.SPECS if s.id == "hm_gain_feature_shift")
    res = run_spec(spec, "smoke", tmp_path)
    assert res["verdict"] == "inconclusive" and set(res["arms"]) == set(spec.arms)
    sep = next(c for c in res["mechanism_checks"] if c["name"] == "domain_separability")
    assert all(v > 0 for v in sep["values"])
    assert all(abs(res["arms"][a]["hm"]["mean"]) <= 1 for a in spec.arms)
