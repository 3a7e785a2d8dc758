"""PGT room, the procedural world: dynamics, grip, visited flags, stage progression and the remaining-path reward
against hand-computed values; the hazard cost; noiseless demos complete every family's plan; layouts and tasks
are what the docstring says; bad input."""

import math

import pytest
import torch

from icml26.methods.pgt import world

pytestmark = pytest.mark.usefixtures("one_thread")


def _scene(family: str, targets, objects=None, hazard=(0.5, 0.5), detour=(0.0, 0.9)):
    """One hand-made scene (leading shape (1,)); stage_obj = 0, 1, 2 (the targets are objects 0, 1, 2)."""
    objects = objects or [[0.5, 0.0], [0.5, 0.4], [-0.5, 0.4], [-0.5, -0.5]]
    t = list(targets) + [targets[-1]] * (3 - len(targets))
    return {"objects": torch.tensor([objects]), "hazard": torch.tensor([hazard]),
            "family": torch.tensor([world.FAMILIES.index(family)]), "targets": torch.tensor([t]),
            "stage_obj": torch.tensor([[0, 1, 2]]), "n_stages": torch.tensor([len(targets)]),
            "detour": torch.tensor([detour])}


def _state(scene, p):
    st = world.reset(scene, torch.Generator().manual_seed(0))
    st["p"] = torch.tensor([p])
    return st


def test_move_clip_wind_gain_and_arena_edge():
    sc = _scene("reach", [[0.5, 0.0]])
    st, _ = world.step(_state(sc, [0.0, 0.0]), torch.tensor([[2.0, -0.5, -1.0]]), sc)
    torch.testing.assert_close(st["p"], torch.tensor([[0.1, -0.05]]))  # clip(2) = 1
    st, _ = world.step(_state(sc, [0.0, 0.0]), torch.tensor([[1.0, 0.0, -1.0]]), sc, world.Dynamics((0.05, 0.02), 0.6))
    torch.testing.assert_close(st["p"], torch.tensor([[0.11, 0.02]]))
    st, _ = world.step(_state(sc, [0.95, 0.0]), torch.tensor([[1.0, 0.0, -1.0]]), sc)
    assert float(st["p"][0, 0]) == 1.0


def test_reward_is_minus_the_remaining_path_and_stages_advance_on_touch():
    a, b = [0.5, 0.0], [0.5, 0.4]
    sc = _scene("via", [a, b])
    st, r = world.step(_state(sc, [0.0, 0.0]), torch.tensor([[1.0, 0.0, -1.0]]), sc)
    # p = (0.1, 0): remaining = |p - a| + |b - a| = 0.4 + 0.4
    assert float(r) == pytest.approx(-0.8) and int(st["stage"]) == 0
    st, r = world.step(_state(sc, [0.3, 0.0]), torch.tensor([[1.0, 0.0, -1.0]]), sc)
    # p = (0.4, 0) is within 0.12 of a: stage 1, remaining = |p - b| = sqrt(0.1^2 + 0.4^2)
    assert int(st["stage"]) == 1 and float(r) == pytest.approx(-math.hypot(0.1, 0.4), abs=1e-6)
    assert st["visited"][0].tolist() == [1.0, 0.0, 0.0, 0.0]
    # the last stage never completes: standing on b keeps stage 1 and reward 0
    st["p"] = torch.tensor([[0.5, 0.4]])
    st, r = world.step(st, torch.tensor([[0.0, 0.0, -1.0]]), sc)
    assert int(st["stage"]) == 1 and float(r) == pytest.approx(0.0, abs=1e-6)


def test_collect_counts_every_remaining_segment():
    t = [[0.5, 0.0], [0.5, 0.4], [-0.5, 0.4]]
    sc = _scene("collect", t)
    _, r = world.step(_state(sc, [-0.1, 0.0]), torch.tensor([[0.0, 0.0, -1.0]]), sc)
    assert float(r) == pytest.approx(-(0.6 + 0.4 + 1.0), abs=1e-6)


def test_grip_picks_up_carries_and_drops_and_fetch_stages():
    a, b = [0.5, 0.0], [0.5, 0.4]
    sc = _scene("fetch", [a, b])
    st = _state(sc, [0.35, 0.0])
    st, r = world.step(st, torch.tensor([[1.0, 0.0, 1.0]]), sc)  # p = (0.45, 0): object 0 within reach, gripped
    assert int(st["held"]) == 0 and int(st["stage"]) == 1
    torch.testing.assert_close(st["q"][0, 0], torch.tensor([0.45, 0.0]))
    assert float(r) == pytest.approx(-math.hypot(0.05, 0.4), abs=1e-6)  # carried object to b
    st, _ = world.step(st, torch.tensor([[0.0, 1.0, 1.0]]), sc)  # carried along
    torch.testing.assert_close(st["q"][0, 0], torch.tensor([0.45, 0.1]))
    st, r = world.step(st, torch.tensor([[-1.0, 0.0, -1.0]]), sc)  # dropped, agent walks away
    assert int(st["held"]) == -1
    torch.testing.assert_close(st["q"][0, 0], torch.tensor([0.45, 0.1]))
    # remaining = |q_a - b| + gap |p - q_a| (the object must be picked up again)
    assert float(r) == pytest.approx(-(math.hypot(0.05, 0.3) + 0.1), abs=1e-6)
    # without grip nothing is ever carried
    sc2 = _scene("reach", [a])
    st2, _ = world.step(_state(sc2, [0.45, 0.0]), torch.tensor([[0.0, 0.0, -1.0]]), sc2)
    assert int(st2["held"]) == -1


def test_hazard_costs_only_in_avoid_tasks():
    h = [0.2, 0.0]
    for fam, cost in (("avoid", 1.0), ("reach", 0.0)):
        sc = _scene(fam, [[0.5, 0.0]], hazard=h)
        _, r = world.step(_state(sc, [0.1, 0.0]), torch.tensor([[1.0, 0.0, -1.0]]), sc)
        assert float(r) == pytest.approx(-0.3 - cost, abs=1e-6)


def test_observation_layout():
    sc = _scene("fetch", [[0.5, 0.0], [0.5, 0.4]])
    st, _ = world.step(_state(sc, [0.4, 0.0]), torch.tensor([[0.0, 0.0, 1.0]]), sc)
    o = world.observe(st, sc)[0]
    assert o.shape == (world.OBS_DIM,)
    torch.testing.assert_close(o[:2], torch.tensor([0.4, 0.0]))
    torch.testing.assert_close(o[2:4], torch.tensor([0.4, 0.0]))  # object 0 carried to the agent
    assert o[10:14].tolist() == [1.0, 0.0, 0.0, 0.0] and o[14:18].tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(o[18:], torch.tensor([0.5, 0.5]))


def test_layouts_and_tasks_follow_their_recipe():
    gen = torch.Generator().manual_seed(0)
    sc = world.sample_scenes(200, gen)
    assert sc["family"].tolist()[:6] == [0, 1, 2, 3, 4, 0]
    r = sc["objects"].norm(dim=-1)
    assert bool((r >= 0.35).all() and (r <= 0.85 + 1e-6).all())
    d = (sc["objects"][:, :, None] - sc["objects"][:, None]).norm(dim=-1) + 9 * torch.eye(4)
    assert float(d.min()) > 0.2  # one object per quadrant: never on top of each other
    so = sc["stage_obj"]
    avoid = sc["family"] == world.FAMILIES.index("avoid")  # one stage: only its object matters
    so_ = so[~avoid]
    assert bool((so_[:, 0] != so_[:, 1]).all() and (so_[:, 1] != so_[:, 2]).all() and (so_[:, 0] != so_[:, 2]).all())
    behind = sc["objects"][torch.arange(200), so[:, 0]][avoid]
    torch.testing.assert_close(sc["hazard"][avoid], 0.55 * behind)


def test_noiseless_demos_complete_every_family():
    gen = torch.Generator().manual_seed(1)
    sc = world.sample_scenes(50, gen)
    st = world.reset(sc, gen)
    inside = torch.zeros(50)
    for _ in range(40):
        st, r = world.step(st, world.demo_action(st, sc), sc)
        inside += ((st["p"] - sc["hazard"]).norm(dim=1) < world.HAZARD_R).float()
    assert bool((st["stage"] == sc["n_stages"] - 1).all())
    assert float(r.max()) <= 0 and float(r.min()) > -0.15  # every plan finished: at most the last step's slack
    avoid = sc["family"] == world.FAMILIES.index("avoid")
    assert float(inside[avoid].mean()) < 1.0  # the demonstrator detours around the hazard


def test_flat_scene_broadcasts_leading_shapes():
    sc = world.sample_scenes(3, torch.Generator().manual_seed(0))
    flat = world.flat_scene(world.index_scene(sc, (None,)), (2, 3), 4)
    assert flat["objects"].shape == (24, 4, 2) and flat["family"].shape == (24,)
    assert flat["family"].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [0] * 4 + [1] * 4 + [2] * 4


@pytest.mark.parametrize("kw,match", [({"family": "teleport"}, "family"), ({"horizon": 0}, "horizon")])
def test_env_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        world.ProcWorldEnv(**kw)
