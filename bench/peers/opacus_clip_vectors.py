#!/usr/bin/env python3
"""Writes rl/tests/fixtures/opacus_clipped_cql.json: Opacus 1.6's per-sample clipped gradient of the
discrete CQL loss (hooks mode, noise multiplier 0), from known parameters on a known batch, so
that fedrl's `clipped_sum` is checked against Opacus (rl/tests/offline_cql.rs).

Usage: python bench/peers/opacus_clip_vectors.py [OUT.json]   (needs torch and opacus==1.6.0)
The recorded `clipped_sum` is Opacus' p.grad times its expected batch size: the sum over
examples of g_i * min(1, C / (|g_i| + 1e-6)). Parameters in fedrl's flat layout.
"""

import copy
import json
import os
import sys
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import opacus_peer as P  # noqa: E402
from opacus import PrivacyEngine  # noqa: E402

warnings.filterwarnings("ignore")
OBS, HIDDEN, ACTIONS, GAMMA, ALPHA, B = 3, [6, 5], 3, 0.95, 0.7, 16


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "rl/tests/fixtures/opacus_clipped_cql.json"
    rng = np.random.default_rng(1)
    net = P.qnet(OBS, HIDDEN, ACTIONS)
    target = P.qnet(OBS, HIDDEN, ACTIONS)
    layers = lambda m: [x for x in m.modules() if isinstance(x, torch.nn.Linear)]  # noqa: E731
    flat = lambda m: [float(v) for l in layers(m) for p in (l.weight, l.bias) for v in p.detach().flatten()]  # noqa: E731
    obs = torch.tensor(rng.uniform(-2, 2, (B, OBS)), dtype=torch.float32)
    nxt = torch.tensor(rng.uniform(-2, 2, (B, OBS)), dtype=torch.float32)
    act = torch.tensor(rng.integers(0, ACTIONS, B))
    rew = torch.tensor(rng.uniform(-3, 3, B), dtype=torch.float32)
    term = torch.tensor((rng.uniform(size=B) < 0.3), dtype=torch.float32)
    cases = []
    for clip in [0.05, 0.5, 5.0]:
        model = copy.deepcopy(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        loader = DataLoader(TensorDataset(obs, act), batch_size=B)
        model, opt, _ = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.0,
            max_grad_norm=clip, poisson_sampling=False)
        opt.zero_grad()
        y = P.double_dqn_target(model, target, rew, nxt, term, GAMMA)
        loss = P.CqlCriterion(ALPHA)(model(obs), torch.stack([y, act.float()], dim=1))
        loss.backward()
        opt.step()
        grads = [float(v) * opt.expected_batch_size
                 for l in layers(model) for p in (l.weight, l.bias) for v in p.grad.flatten()]
        cases.append({"clip_norm": clip, "clipped_sum": grads})
    doc = {
        "meta": {
            "produced_by": "Opacus 1.6 hooks mode, noise 0 (torch %s), "
                           "bench/peers/opacus_clip_vectors.py" % torch.__version__,
            "obs_dim": OBS, "hidden": HIDDEN, "n_actions": ACTIONS, "gamma": GAMMA, "alpha": ALPHA,
            "note": "one row per unit; Opacus clips with min(1, C / (|g_i| + 1e-6))",
        },
        "params": flat(net), "target": flat(target),
        "obs": [float(v) for v in obs.flatten()], "next_obs": [float(v) for v in nxt.flatten()],
        "actions": [int(a) for a in act], "rewards": [float(r) for r in rew],
        "terminals": [float(t) for t in term],
        "cases": cases,
    }
    with open(out, "w") as f:
        json.dump(doc, f)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
