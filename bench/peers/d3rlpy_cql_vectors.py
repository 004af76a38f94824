#!/usr/bin/env python3
"""Writes rl/tests/fixtures/d3rlpy_discrete_cql.json: d3rlpy 2.8.1's own DiscreteCQL (its loss, its Adam,
its target-sync schedule) run for a few updates from known parameters on known batches, so that
fedrl's CQL (rl/tests/offline_cql.rs) is checked against the implementation it claims to match.

Usage: python bench/peers/d3rlpy_cql_vectors.py [OUT.json]   (needs d3rlpy==2.8.1 and torch)
Parameters travel in fedrl's flat layout: per layer weight [out, in] then bias [out].
"""

import json
import sys

import d3rlpy
import numpy as np
import torch
from d3rlpy.dataset import Transition, TransitionMiniBatch

OBS, HIDDEN, ACTIONS = 3, [6, 5], 3
GAMMA, ALPHA, LR, INTERVAL, STEPS, BATCH = 0.95, 0.7, 1e-3, 3, 6, 8


def linears(q_func):
    return [m for m in q_func.modules() if isinstance(m, torch.nn.Linear)]


def flat(q_func):
    return [float(x) for m in linears(q_func) for p in (m.weight, m.bias) for x in p.detach().flatten()]


def flat_grad(q_func):
    return [float(x) for m in linears(q_func) for p in (m.weight, m.bias) for x in p.grad.flatten()]


def load(q_func, values):
    it = 0
    with torch.no_grad():
        for m in linears(q_func):
            for p in (m.weight, m.bias):
                n = p.numel()
                p.copy_(torch.tensor(values[it:it + n], dtype=torch.float32).view_as(p))
                it += n
    assert it == len(values)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "rl/tests/fixtures/d3rlpy_discrete_cql.json"
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    cfg = d3rlpy.algos.DiscreteCQLConfig(
        encoder_factory=d3rlpy.models.VectorEncoderFactory(hidden_units=HIDDEN),
        learning_rate=LR, batch_size=BATCH, gamma=GAMMA, alpha=ALPHA,
        target_update_interval=INTERVAL)
    cql = cfg.create(device="cpu:0")
    cql.create_impl((OBS,), ACTIONS)
    q = cql.impl.modules.q_funcs[0]
    targ = cql.impl.modules.targ_q_funcs[0]
    names = [n for n, _ in q.named_parameters()]
    sizes = [OBS] + HIDDEN + [ACTIONS]
    init = []
    for i, o in zip(sizes[:-1], sizes[1:]):
        b = 1.0 / np.sqrt(i)
        init += [float(x) for x in rng.uniform(-b, b, size=o * i + o).astype(np.float32)]
    load(q, init)
    load(targ, init)
    steps = []
    for _ in range(STEPS):
        obs = rng.uniform(-2, 2, (BATCH, OBS)).astype(np.float32)
        nxt = rng.uniform(-2, 2, (BATCH, OBS)).astype(np.float32)
        act = rng.integers(0, ACTIONS, BATCH)
        rew = rng.uniform(-3, 3, BATCH).astype(np.float32)
        term = (rng.uniform(size=BATCH) < 0.3).astype(np.float32)
        ts = [Transition(observation=obs[i], action=np.array([act[i]]), reward=np.array([rew[i]], dtype=np.float32),
                         next_observation=nxt[i], next_action=np.array([0]), terminal=float(term[i]), interval=1,
                         rewards_to_go=np.zeros((1, 1), dtype=np.float32))
              for i in range(BATCH)]
        metrics = cql.update(TransitionMiniBatch.from_transitions(ts))
        steps.append({
            "obs": [float(x) for x in obs.flatten()], "next_obs": [float(x) for x in nxt.flatten()],
            "actions": [int(a) for a in act], "rewards": [float(r) for r in rew],
            "terminals": [float(t) for t in term],
            "loss": float(metrics["loss"]), "grad": flat_grad(q),
            "params_after": flat(q), "target_after": flat(targ),
        })
    doc = {
        "meta": {
            "produced_by": f"d3rlpy {d3rlpy.__version__} DiscreteCQL (torch {torch.__version__}), "
                           "bench/peers/d3rlpy_cql_vectors.py",
            "torch_parameter_names": names,
            "obs_dim": OBS, "hidden": HIDDEN, "n_actions": ACTIONS, "gamma": GAMMA, "alpha": ALPHA,
            "learning_rate": LR, "adam_eps": 1e-8, "target_update_interval": INTERVAL,
            "note": "each step: the batch, d3rlpy's loss and gradient at that step (before its "
                    "Adam step), and the online and target parameters after it",
        },
        "init": init,
        "steps": steps,
    }
    with open(out, "w") as f:
        json.dump(doc, f)
    print(f"wrote {out}: {STEPS} steps, {len(init)} parameters, names {names}")


if __name__ == "__main__":
    main()
