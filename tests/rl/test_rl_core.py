"""Shared RL core: the nav env through Gymnasium's own checker, D4RL-layout IO and errors, buffers, scores."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from icml26.rl import NAV_ENV_ID, PointNavWallEnv, make_env
from icml26.rl.behavior import LEVELS, generate, main, waypoint_action
from icml26.rl.buffers import OfflineBuffer, OnlineBuffer, mixed_batch
from icml26.rl.checkpoint import load_checkpoint, save_checkpoint
from icml26.rl.datasets import (DatasetError, KEYS, content_hash, episode_returns, load_dataset, save_dataset,
                                validate)
from icml26.rl.evaluation import REF_RETURNS, evaluate_policy, measure_reference_returns, normalized_score

pytestmark = pytest.mark.usefixtures("one_thread")


def test_env_passes_gymnasium_checker_and_is_registered():
    check_env(PointNavWallEnv())
    env = gym.make(NAV_ENV_ID)
    obs, _ = env.reset(seed=3)
    assert env.observation_space.contains(obs)


def test_wall_blocks_and_goal_terminates():
    env = PointNavWallEnv(start_noise=0.0)
    env.reset(seed=0)
    env.unwrapped._pos = np.array([-0.5, -0.05])
    obs, r, term, trunc, _ = env.step(np.array([0.0, 1.0]))  # straight up into the wall: cancelled
    assert np.allclose(obs, [-0.5, -0.05]) and r == 0.0 and not term
    env._pos = PointNavWallEnv.GOAL + np.array([0.0, -0.12])
    obs, r, term, trunc, info = env.step(np.array([0.0, 1.0]))
    assert r == 1.0 and term and info["success"]


def test_bad_env_id_names_supported_ids():
    with pytest.raises(ValueError, match="PointNavWall"):
        make_env("NoSuchEnv-v9")


def test_reference_returns_match_pinned_values():
    assert measure_reference_returns(episodes=20) == REF_RETURNS[NAV_ENV_ID]
    assert normalized_score(0.5) == 50.0


def test_expert_controller_succeeds_and_levels_order():
    env = make_env(NAV_ENV_ID)
    ev = evaluate_policy(env, lambda o: waypoint_action(o)[0].astype(np.float32), 5, seed=0)
    assert ev["success"] == 1.0 and ev["length"] < 40
    means = {lv: episode_returns(generate(lv, 1500, seed=1)).mean() for lv in ("expert", "medium", "random")}
    assert means["expert"] > means["medium"] > means["random"] == 0.0


@pytest.mark.parametrize("suffix", [".npz", ".hdf5"])
def test_d4rl_round_trip_and_hash(tmp_path, suffix):
    if suffix == ".hdf5":
        pytest.importorskip("h5py")
    data = generate("medium-replay", 300, seed=2)
    assert set(data) == set(KEYS) and data["terminals"].sum() + data["timeouts"].sum() >= 1
    path = save_dataset(data, tmp_path / f"d{suffix}", metadata={"level": "medium-replay"})
    back, meta = load_dataset(path)
    assert content_hash(back) == content_hash(data) == meta["content_hash"] and meta["level"] == "medium-replay"
    for k in KEYS:
        np.testing.assert_array_equal(back[k], data[k])


def test_malformed_datasets_give_clear_errors(tmp_path):
    data = generate("random", 50, seed=0)
    with pytest.raises(DatasetError, match="missing D4RL key"):
        validate({k: v for k, v in data.items() if k != "timeouts"})
    with pytest.raises(DatasetError, match="same number of rows"):
        validate({**data, "rewards": data["rewards"][:-1]})
    bad = {**data, "rewards": data["rewards"].copy()}
    bad["rewards"][7] = np.nan
    with pytest.raises(DatasetError, match="'rewards' has 1 non-finite"):
        validate(bad)
    with pytest.raises(DatasetError, match="0/1"):
        validate({**data, "terminals": data["terminals"] + 0.5})
    path = save_dataset(data, tmp_path / "d.npz")
    raw = dict(np.load(path))
    raw["rewards"] = raw["rewards"] + 1
    np.savez(tmp_path / "tampered.npz", **raw)
    with pytest.raises(DatasetError, match="content hash"):
        load_dataset(tmp_path / "tampered.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DatasetError, match="not a readable"):
        load_dataset(tmp_path / "junk.npz")
    with pytest.raises(DatasetError, match="unsupported file type"):
        load_dataset(path.rename(tmp_path / "d.csv"))


def test_cli_writes_dataset(tmp_path, capsys):
    main(["--level", "expert", "--transitions", "120", "--out", str(tmp_path / "e.npz")])
    assert load_dataset(tmp_path / "e.npz")[1]["level"] == "expert"
    assert '"transitions": 120' in capsys.readouterr().out


def test_buffers_keep_origins_apart():
    data = generate("medium", 200, seed=0)
    off = OfflineBuffer(data, reward_bias=-1.0)
    on = OnlineBuffer(2, 2, capacity=3, reward_bias=-1.0)
    gen = torch.Generator().manual_seed(0)
    batch, origin = mixed_batch(off, on, 8, 0.5, gen)
    assert origin.all() and batch["rewards"].max() <= 0.0  # empty online buffer: all offline
    for i in range(5):  # ring buffer overwrites the oldest
        on.add([i, i], [0.1, 0.2], 1.0, [i, i], terminal=i == 4)
    assert len(on) == 3 and on._t["observations"][:, 0].tolist() == [3.0, 4.0, 2.0]
    batch, origin = mixed_batch(off, on, 10, 0.3, gen)
    assert origin.sum() == 3 and torch.all(batch["rewards"][~origin] == 0.0)
    state = on.state_dict()
    on2 = OnlineBuffer(2, 2, capacity=3)
    on2.load_state_dict(state)
    assert torch.equal(on2._t["dones"], on._t["dones"]) and on2.ptr == on.ptr


def test_checkpoint_is_atomic_and_round_trips(tmp_path):
    assert load_checkpoint(tmp_path / "none.pt") is None
    save_checkpoint(tmp_path / "c.pt", {"w": torch.arange(3), "step": 7})
    back = load_checkpoint(tmp_path / "c.pt")
    assert back["step"] == 7 and torch.equal(back["w"], torch.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary left behind


def test_levels_listed():
    assert LEVELS == ("expert", "medium", "medium-replay", "random")
