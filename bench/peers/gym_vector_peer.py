"""Gymnasium's own vector environments stepping random actions: the peer of the bridge's
overhead bench (bench/run_gym_bridge.sh, issue 57).

    python gym_vector_peer.py ENV_ID BATCH STEPS async|sync

`async`: gymnasium.vector.AsyncVectorEnv, one process per environment (BATCH processes);
`sync`: SyncVectorEnv, every environment in this one process. Both autoreset (next-step mode).
Prints one JSON line: environment steps per second over the stepping only.
"""

import json
import sys
import time

import gymnasium as gym
import numpy as np


def main():
    env_id = sys.argv[1]
    batch = int(sys.argv[2])
    steps = int(sys.argv[3])
    kind = sys.argv[4]
    fns = [lambda: gym.make(env_id) for _ in range(batch)]
    venv = gym.vector.AsyncVectorEnv(fns) if kind == "async" else gym.vector.SyncVectorEnv(fns)
    venv.reset(seed=list(range(batch)))
    venv.action_space.seed(0)
    actions = [venv.action_space.sample() for _ in range(steps)]
    t0 = time.perf_counter()
    for a in actions:
        venv.step(a)
    secs = time.perf_counter() - t0
    venv.close()
    print(
        json.dumps(
            {
                "impl": f"gymnasium.vector.{'Async' if kind == 'async' else 'Sync'}VectorEnv",
                "env": env_id,
                "batch": batch,
                "processes": batch if kind == "async" else 1,
                "lockstep_steps": steps,
                "env_steps": batch * steps,
                "seconds": secs,
                "steps_per_s": batch * steps / secs,
                "gymnasium": gym.__version__,
                "numpy": np.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
