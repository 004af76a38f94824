"""Generates gymnasium_edge_traces.json: Gymnasium 1.4.0 episodes that reach the edges the
reference traces in testdata/ do not (Acrobot and MountainCar reaching their goals, CartPole
balanced until truncation and stepped past termination, Pendulum actions far outside [-2, 2]).

Run with the peer virtual environment: bench/peers/.venv/bin/python make_edge_traces.py
"""

import json
import math

import gymnasium as gym
import numpy as np


def record(env_id, seed, policy, n_steps, continuous=False, steps_after_end=0):
    env = gym.make(env_id)
    obs, _ = env.reset(seed=seed)
    ep = {
        "seed": seed,
        "initial_state": [float(x) for x in env.unwrapped.state],
        "initial_obs": [float(x) for x in obs],
        "steps": [],
    }
    for t in range(n_steps):
        a = policy(obs, t)
        if continuous:
            obs, r, term, trunc, _ = env.step(np.array([a], dtype=np.float32))
            a = float(np.float32(a))
        else:
            obs, r, term, trunc, _ = env.step(int(a))
        ep["steps"].append(
            {
                "action": a,
                "obs": [float(x) for x in obs],
                "reward": float(r),
                "terminated": bool(term),
                "truncated": bool(trunc),
            }
        )
        if term or trunc:
            if steps_after_end == 0:
                break
            steps_after_end -= 1
    return ep


def main():
    envs = {}
    # Balanced until the 500-step limit.
    envs["CartPole-v1"] = [
        record("CartPole-v1", s, lambda o, t: int(o[2] + 0.5 * o[3] > 0), 600) for s in (7, 8)
    ]
    # Stepped past termination: Gymnasium then pays 0 (and warns).
    envs["CartPole-v1"].append(
        record("CartPole-v1", 9, lambda o, t: 1, 100, steps_after_end=3)
    )
    # Pumping energy with the second joint's velocity reaches the goal height.
    envs["Acrobot-v1"] = [
        record("Acrobot-v1", s, lambda o, t: 2 if o[5] > 0 else 0, 500) for s in (3, 4, 5)
    ]
    # Pushing with the velocity reaches the flag.
    envs["MountainCar-v0"] = [
        record("MountainCar-v0", s, lambda o, t: 2 if o[1] >= 0 else 0, 200) for s in (3, 4)
    ]
    rng = np.random.default_rng(11)
    envs["Pendulum-v1"] = [
        record("Pendulum-v1", 9, lambda o, t: float(rng.uniform(-6.0, 6.0)), 200, True)
    ]
    out = {
        "meta": {
            "source": "gymnasium %s edge cases, made by simulators/tests/data/make_edge_traces.py"
            % gym.__version__
        },
        "envs": envs,
    }
    with open("gymnasium_edge_traces.json", "w") as f:
        json.dump(out, f)
    for k, v in envs.items():
        print(k, [(len(e["steps"]), e["steps"][-1]["terminated"], e["steps"][-1]["truncated"]) for e in v])


if __name__ == "__main__":
    main()
