"""Gymnasium's steps per second on the classic-control environments, measured like
bench/benches/simulators.rs: random actions drawn beforehand, only env.step (and the resets it
triggers) timed.

Two variants per environment:
  make       gym.make(id): the wrappers every user gets (TimeLimit, OrderEnforcing,
             PassiveEnvChecker) -- the fair peer of fedrl-sim's env, which includes the time limit.
  unwrapped  env.unwrapped with the time limit counted by hand: the bare dynamics.

Prints one JSON object per line. Usage: python gymnasium_peer.py [--seconds S] [--env ID ...]
"""

import argparse
import json
import time

import gymnasium as gym
import numpy as np

ENVS = ["CartPole-v1", "Acrobot-v1", "Pendulum-v1", "MountainCar-v0"]
N_ACTIONS = 1 << 16


def draw_actions(space, rng):
    if isinstance(space, gym.spaces.Discrete):
        return [int(a) for a in rng.integers(0, space.n, size=N_ACTIONS)]
    low, high = space.low.astype(np.float64), space.high.astype(np.float64)
    return [
        (low + (high - low) * rng.random(low.shape)).astype(np.float32) for _ in range(N_ACTIONS)
    ]


def run_make(env, actions, steps, state):
    episodes = 0
    for t in range(steps):
        _, _, term, trunc, _ = env.step(actions[t & (N_ACTIONS - 1)])
        if term or trunc:
            episodes += 1
            state["seed"] += 1
            env.reset(seed=state["seed"])
    return episodes


def run_unwrapped(env, actions, steps, state, horizon):
    episodes = 0
    for t in range(steps):
        _, _, term, _, _ = env.step(actions[t & (N_ACTIONS - 1)])
        state["elapsed"] += 1
        if term or state["elapsed"] >= horizon:
            episodes += 1
            state["seed"] += 1
            state["elapsed"] = 0
            env.reset(seed=state["seed"])
    return episodes


def measure(fn, budget):
    batch = 64
    while True:
        t0 = time.perf_counter()
        fn(batch)
        if (time.perf_counter() - t0) * 10 >= budget:
            break
        batch *= 2
    steps = episodes = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < budget:
        episodes += fn(batch)
        steps += batch
    return steps / (time.perf_counter() - t0), steps, episodes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--env", action="append")
    args = ap.parse_args()
    for env_id in args.env or ENVS:
        rng = np.random.default_rng(12345)
        env = gym.make(env_id)
        horizon = env.spec.max_episode_steps
        actions = draw_actions(env.action_space, rng)
        state = {"seed": 0, "elapsed": 0}
        env.reset(seed=0)
        rate, steps, eps = measure(lambda n: run_make(env, actions, n, state), args.seconds)
        print(json.dumps({"env": env_id, "impl": "gymnasium", "variant": "make",
                          "version": gym.__version__, "steps_per_second": rate,
                          "steps": steps, "episodes": eps}), flush=True)
        raw = env.unwrapped
        state = {"seed": 0, "elapsed": 0}
        raw.reset(seed=0)
        rate, steps, eps = measure(
            lambda n: run_unwrapped(raw, actions, n, state, horizon), args.seconds)
        print(json.dumps({"env": env_id, "impl": "gymnasium", "variant": "unwrapped",
                          "version": gym.__version__, "steps_per_second": rate,
                          "steps": steps, "episodes": eps}), flush=True)


if __name__ == "__main__":
    main()
