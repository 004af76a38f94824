#!/usr/bin/env python3
"""How much two sets of *real* CartPole transitions disagree, by the way they are split: the
units (the first N transitions in episode order) against the held-out data (N transitions of the
episodes after them), against two random halves of the same dataset. Prints 1 - KS per state
entry (the marginal fidelity's terms). No fedrl output is read: the dataset only.

    bench/peers/.venv-offline/bin/python bench/peers/privorl_split_check.py \
        $FEDRL_DATA_DIR/fedrl/cartpole-ppo_mixed-361819d8-v0 [--n 5000]
"""
import argparse
import glob
import os

import numpy as np
import pyarrow.parquet as pq


def load(folder):
    """States and episode indices of every transition, episodes in id order."""
    eps = sorted(
        glob.glob(os.path.join(folder, "data", "*", "")),
        key=lambda p: int(os.path.basename(p.rstrip("/"))),
    )
    states, episode = [], []
    for i, ep in enumerate(eps):
        files = glob.glob(os.path.join(ep, "*.parquet")) + glob.glob(os.path.join(ep, "*.arrow"))
        obs = np.asarray(pq.read_table(files[0]).to_pydict()["observations"])
        states.append(obs[:-1])
        episode.append(np.full(len(obs) - 1, i))
    return np.concatenate(states), np.concatenate(episode)


def ks(a, b):
    a, b = np.sort(a), np.sort(b)
    x = np.concatenate([a, b])
    fa = np.searchsorted(a, x, side="right") / len(a)
    fb = np.searchsorted(b, x, side="right") / len(b)
    return float(np.max(np.abs(fa - fb)))


def scores(a, b):
    return [round(1 - ks(a[:, j], b[:, j]), 3) for j in range(a.shape[1])]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dataset", help="a fedrl Minari folder (FEDRL_DATA_DIR/fedrl/<id>)")
    p.add_argument("--n", type=int, default=5000)
    a = p.parse_args()
    s, e = load(a.dataset)
    n = a.n
    start = int(np.searchsorted(e, e[n - 1] + 1))
    units, held = s[:n], s[start : start + n]
    print(f"{len(s)} transitions in {e[-1] + 1} episodes")
    print(f"episode split: units {len(set(e[:n]))} episodes, held-out {len(set(e[start:start + n]))}")
    print("  1 - KS, units vs held-out:", scores(units, held))
    perm = np.random.default_rng(0).permutation(len(s))
    print("random split:  1 - KS, half vs half:", scores(s[perm[:n]], s[perm[n : 2 * n]]))


if __name__ == "__main__":
    main()
