"""The d3rlpy peer of fedrl's discrete CQL: trains d3rlpy's DiscreteCQL with its default config on
a dataset fedrl wrote (opened with `minari.load_dataset`) and evaluates it greedily in the
Gymnasium environment the dataset names. Prints one JSON object:
{return_mean, return_std, train_s, wall_s, ...}.

    bench/peers/.venv-offline/bin/python bench/peers/d3rlpy_cql.py \
        --root DATASET_ROOT --id fedrl/cartpole-ppo_mixed-XXXXXXXX-v0 \
        --steps 10000 --seed 0 --eval-episodes 20

`DiscreteCQLConfig()` defaults (d3rlpy 2.8.1: lr 6.25e-5, batch 32, gamma 0.99, alpha 1,
target update every 8000 steps, 256-256 ReLU encoder), trained with
`fit(dataset, n_steps=..., n_steps_per_epoch=...)` as d3rlpy's documentation does. Torch uses
2 threads. train_s is the time inside `fit`; wall_s the whole process (imports included).
Evaluation episodes reset with seeds 1_000_000 + i, which the dataset never uses for its own
episodes (fedrl mixes its reset seeds from the spec), with the environment's own time limit.
"""

import time

WALL0 = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True, help="dataset root (MINARI_DATASETS_PATH)")
    p.add_argument("--id", required=True, help="Minari dataset id")
    p.add_argument("--steps", type=int, required=True, help="gradient steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-episodes", type=int, default=20)
    p.add_argument("--steps-per-epoch", type=int, default=0,
                   help="n_steps_per_epoch (default: min(steps, 10000))")
    a = p.parse_args()
    os.environ["MINARI_DATASETS_PATH"] = os.path.abspath(a.root)
    # d3rlpy logs to stdout; stdout carries only the result line.
    with contextlib.redirect_stdout(sys.stderr):
        result = run(a)
    print(json.dumps(result))


def run(a: argparse.Namespace) -> dict:
    import d3rlpy
    import gymnasium as gym
    import minari
    import numpy as np
    import torch

    torch.set_num_threads(2)
    d3rlpy.seed(a.seed)

    ds = minari.load_dataset(a.id)
    obs, acts, rews, terms, timeouts = [], [], [], [], []
    for ep in ds.iterate_episodes():
        # Minari stores steps + 1 observations (the last is the state after the final step);
        # d3rlpy's MDPDataset wants one observation per step. (d3rlpy 2.8.1's own
        # `get_minari` concatenates all steps + 1 rows, misaligning every later episode.)
        obs.append(np.asarray(ep.observations[:-1], dtype=np.float32))
        acts.append(np.asarray(ep.actions, dtype=np.int64))
        rews.append(np.asarray(ep.rewards, dtype=np.float32))
        terms.append(np.asarray(ep.terminations, dtype=np.float32))
        # d3rlpy refuses a step that is both terminal and timed out (Gymnasium reports both when
        # the pole falls on the time limit's last step): termination wins, it decides the
        # target. An episode whose last step is neither still closes as a timeout: d3rlpy
        # splits episodes on terminal or timeout. fedrl no longer writes either case (a step
        # that terminates is never also a truncation, rl/src/offline/generate.rs, and every
        # episode ends on one of them; bench/peers/minari_formats.py builds d3rlpy's dataset
        # from the flags as they are): these lines only matter for datasets cached by an
        # older fedrl or written by other tools.
        term = np.asarray(ep.terminations, dtype=bool)
        t = np.asarray(ep.truncations, dtype=bool) & ~term
        if not (term[-1] or t[-1]):
            t[-1] = True
        timeouts.append(t.astype(np.float32))
    dataset = d3rlpy.dataset.MDPDataset(
        observations=np.concatenate(obs),
        actions=np.concatenate(acts),
        rewards=np.concatenate(rews),
        terminals=np.concatenate(terms),
        timeouts=np.concatenate(timeouts),
        action_space=d3rlpy.ActionSpace.DISCRETE,
        action_size=int(ds.action_space.n),
    )

    cql = d3rlpy.algos.DiscreteCQLConfig().create(device="cpu:0")
    per_epoch = a.steps_per_epoch or min(a.steps, 10000)
    t0 = time.perf_counter()
    cql.fit(
        dataset,
        n_steps=a.steps,
        n_steps_per_epoch=per_epoch,
        show_progress=False,
        save_interval=a.steps + 1,
        logger_adapter=d3rlpy.logging.NoopAdapterFactory(),
    )
    train_s = time.perf_counter() - t0

    env = gym.make(ds.env_spec.id)
    returns = []
    for i in range(a.eval_episodes):
        o, _ = env.reset(seed=1_000_000 + i)
        total, done = 0.0, False
        while not done:
            act = int(cql.predict(np.asarray(o, dtype=np.float32)[None])[0])
            o, r, term, trunc, _ = env.step(act)
            total += float(r)
            done = term or trunc
        returns.append(total)
    r = np.asarray(returns)
    return {
        "id": a.id,
        "env": ds.env_spec.id,
        "seed": a.seed,
        "steps": a.steps,
        "transitions": int(dataset.transition_count),
        "eval_episodes": a.eval_episodes,
        "return_mean": float(r.mean()),
        "return_std": float(r.std()),
        "train_s": train_s,
        "wall_s": time.perf_counter() - WALL0,
    }


if __name__ == "__main__":
    main()
