"""Our SAC (behavior policies for the MuJoCo datasets): it learns a one-step bandit, a killed MuJoCo training run
resumes to the same state, snapshot choice follows D4RL's medium / expert definitions, and records are D4RL-layout."""

import json

import numpy as np
import pytest
import torch

from icml26.rl.buffers import OfflineBuffer
from icml26.rl.sac import SAC, cached_mujoco_dataset, choose_snapshots, record, train_sac

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_sac_learns_a_one_step_bandit(one_step_bandit):
    data, obs, target = one_step_bandit
    agent = SAC(2, 2, hidden=32, batch_size=64, lr=1e-3, seed=0)
    off = OfflineBuffer(data)
    for _ in range(300):
        agent.update(off.sample(64, agent.gen))
    err = np.abs(agent.actor(torch.as_tensor(obs)).detach().numpy() - target)
    assert err.mean() < 0.15


def test_choose_snapshots_follows_d4rl_definitions():
    snaps = [[10, 5.0], [20, 40.0], [30, 120.0], [40, 300.0], [50, 280.0]]
    picks = choose_snapshots(snaps, r_random=0.0)
    assert picks["expert"] == (40, 300.0) and picks["medium"] == (30, 120.0)  # first >= 0 + 300 / 3
    with pytest.raises(ValueError, match="train first"):
        choose_snapshots([], 0.0)
    with pytest.raises(ValueError, match="beats random"):
        choose_snapshots([[10, -5.0]], 0.0)


@pytest.mark.slow
def test_killed_sac_run_resumes_and_records(tmp_path):
    pytest.importorskip("mujoco")
    kw = dict(seed=0, start_steps=100, snapshot_every=100, eval_episodes=1, checkpoint_every=50, hidden=16,
              batch_size=32)
    full = train_sac("Hopper-v5", 300, out=tmp_path / "a", **kw)
    part = train_sac("Hopper-v5", 300, out=tmp_path / "b", stop_after=200, **kw)
    assert part["steps_done"] == 200
    resumed = train_sac("Hopper-v5", 300, out=tmp_path / "b", **kw)
    assert resumed["snapshots"] == full["snapshots"]
    a, b = torch.load(tmp_path / "a" / "checkpoint.pt"), torch.load(tmp_path / "b" / "checkpoint.pt")
    for k in a["agent"]["actor"]:
        assert torch.equal(a["agent"]["actor"][k], b["agent"]["actor"][k])
    # D4RL's levels from a crafted snapshot table: expert = step 300, medium = step 200 (first >= 1/3 of the way)
    (tmp_path / "a" / "snapshots.json").write_text(json.dumps({"snapshots": [[100, 1e6], [200, 2e6], [300, 3e6]]}))
    rec = record("Hopper-v5", "medium-replay", 10, src=tmp_path / "a")
    assert len(rec["data"]["rewards"]) == 200 and rec["meta"]["sac_medium_step"] == 200
    assert rec["meta"]["ref_expert"] == 3e6 and rec["meta"]["ref_random"] < 1e3
    med = record("Hopper-v5", "medium", 25, src=tmp_path / "a")["data"]
    assert med["observations"].shape == (25, 11) and med["timeouts"][-1] + med["terminals"][-1] == 1
    with pytest.raises(FileNotFoundError, match="python -m icml26.rl.sac train"):
        cached_mujoco_dataset("Hopper-v5", "medium", 123, seed=99)
