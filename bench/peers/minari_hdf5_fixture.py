"""Writes the HDF5 test fixture of `fedrl-rl`'s `hdf5` feature (rl/tests/minari_hdf5.rs):
three CartPole-v1 episodes of uniformly random actions recorded by
`minari.DataCollector(env, data_format="hdf5")` (reset seeds 0, 1, 2; actions from
`numpy.random.default_rng(0)`), episode 0 given unit 7 and episode 2 unit 3 through Minari's
`update_episode_metadata` (episode 1 names none), and `expected.json` beside it: what Minari
itself reads back (every observation, action, reward and flag).

    bench/peers/.venv-offline/bin/python bench/peers/minari_hdf5_fixture.py testdata/minari_hdf5
"""

import json
import os
import shutil
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_ROOT")
    root = Path(sys.argv[1]).resolve()
    dataset_id = "peer/cartpole-tiny-v0"
    shutil.rmtree(root / "peer", ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    os.environ["MINARI_DATASETS_PATH"] = str(root)
    import gymnasium as gym
    import minari
    import numpy as np
    from minari import DataCollector

    env = DataCollector(gym.make("CartPole-v1"), data_format="hdf5")
    rng = np.random.default_rng(0)
    for i in range(3):
        env.reset(seed=i)
        done = False
        while not done:
            _, _, term, trunc, _ = env.step(int(rng.integers(2)))
            done = term or trunc
    ds = env.create_dataset(dataset_id=dataset_id, algorithm_name="uniform random")
    env.close()
    ds.storage.update_episode_metadata([{"unit": 7}, {}, {"unit": 3}], [0, 1, 2])
    back = minari.load_dataset(dataset_id)
    episodes = []
    for ep, meta in zip(back.iterate_episodes(),
                        back.storage.get_episode_metadata(back.episode_indices)):
        episodes.append({
            "unit": int(meta["unit"]) if "unit" in meta else None,
            "observations": [float(x) for x in np.asarray(ep.observations).ravel()],
            "actions": [int(a) for a in ep.actions],
            "rewards": [float(r) for r in ep.rewards],
            "terminations": [bool(t) for t in ep.terminations],
            "truncations": [bool(t) for t in ep.truncations],
        })
    expected = {"id": dataset_id, "env_id": "CartPole-v1", "obs_dim": 4, "n_actions": 2,
                "total_steps": int(back.total_steps), "episodes": episodes,
                "minari_version": minari.__version__}
    (root / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"wrote {root / dataset_id} ({back.total_steps} steps)")


if __name__ == "__main__":
    main()
