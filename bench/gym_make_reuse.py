"""What a bridge worker's MAKE costs per round, with and without `reuse_envs` (issue 57).

One worker (`fedrl_bridge.worker.Worker`, in this process) makes a round's environments 8 times:
64 `fedrl/HalfCheetah-v5` users a round drawn from the 5 x 5 (mass, friction) grid of
scenarios/halfcheetah-dppg.toml (a worker's share of its 128-user rounds), and 256 CartPole-v1
users without kwargs (a worker's share of 512-user rounds). Prints one JSON line per case: mean
seconds of a MAKE after the first round, environments made and reused.
Run from the repository root: .venv-bridge/bin/python bench/gym_make_reuse.py
"""
import json, os, random, sys, time
sys.path.insert(0, "python")
from fedrl_bridge.worker import Worker
import fedrl_bridge.mujoco_users  # noqa
def bench(env_id, kwargs_of, n, rounds, reuse):
    w = Worker(); w.init({"env_id": env_id, "probe_kwargs": {}, "reuse_envs": reuse})
    rng = random.Random(0); ts = []
    for r in range(rounds):
        kws = [kwargs_of(rng) for _ in range(n)]
        t = time.perf_counter(); w.make(kws); ts.append(time.perf_counter() - t)
    w.close_envs()
    return sum(ts[1:]) / (rounds - 1), w.made, w.reused
grid = lambda rng: {"mass_scale": 0.75 + 0.125 * rng.randrange(5), "friction_scale": 0.6 + 0.2 * rng.randrange(5)}
out = []
for env_id, kw, n in [("fedrl/HalfCheetah-v5", grid, 64), ("CartPole-v1", lambda rng: {}, 256)]:
    for reuse in (False, True):
        s, made, reused = bench(env_id, kw, n, 8, reuse)
        out.append({"env": env_id, "slots_per_worker": n, "reuse_envs": reuse, "make_seconds_per_round": round(s, 4), "made": made, "reused": reused, "rounds": 8})
        print(json.dumps(out[-1]), flush=True)
