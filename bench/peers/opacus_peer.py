#!/usr/bin/env python3
"""Peer of bench/benches/per_example.rs: per-example clipped gradients of the discrete CQL loss
in PyTorch and Opacus, on the same network (8-256-256-4 ReLU MLP), batch (256) and loss.

Modes (examples/s of one step: forward, backward, clipping where private, an SGD step):
- plain:  PyTorch without privacy (mean loss, one backward);
- hooks:  Opacus 1.6 `make_private` with the default per-sample-gradient hooks;
- ghost:  Opacus 1.6 ghost clipping (`grad_sample_mode="ghost"`), which needs the criterion to
          return a per-example loss vector (Opacus wraps it and runs its two backward passes).

Loss per example i (as fedrl and d3rlpy's DiscreteCQL compute it): Huber(1) TD error on the
double-DQN target (no gradient), plus alpha (logsumexp_a Q(s_i, a) - Q(s_i, a_i)).
Clip norm 1 for Opacus; noise multiplier `--noise` (default 0: the noise is not measured; Opacus'
own examples run with it on, as bench/run_central_step.sh does with `--noise 1`, whose lines
carry case "ghost_noise" / "hooks_noise").

Usage: python bench/peers/opacus_peer.py [--batch 256] [--threads 2] [--seconds 3]
       [--hidden 256,256] [--modes plain,hooks,ghost] [--repeats 1] [--noise 0]
Prints one JSON line per mode (and repeat); `--hidden 1024,1024` is the ~1 M-parameter MLP of
bench/run_central_step.sh.
"""

import argparse
import copy
import json
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

warnings.filterwarnings("ignore")


def qnet(obs_dim, hidden, n_actions):
    layers, width = [], obs_dim
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, n_actions))
    return nn.Sequential(*layers)


class CqlCriterion(nn.Module):
    """Per-example CQL loss of Q-values `q` given a packed target `[y, action]` per row.
    `reduction` is what Opacus' ghost-clipping wrapper switches to "none"."""

    def __init__(self, alpha, reduction="mean"):
        super().__init__()
        self.alpha = alpha
        self.reduction = reduction

    def forward(self, q, packed):
        y = packed[:, 0]
        a = packed[:, 1].long()
        q_data = q.gather(1, a.unsqueeze(1)).squeeze(1)
        td = F.smooth_l1_loss(q_data, y, reduction="none", beta=1.0)
        loss = td + self.alpha * (torch.logsumexp(q, dim=1) - q_data)
        if self.reduction == "none":
            return loss
        if self.reduction == "sum":
            return loss.sum()
        return loss.mean()


def double_dqn_target(online, target, rewards, next_obs, terminals, gamma):
    with torch.no_grad():
        a_star = online(next_obs).argmax(dim=1, keepdim=True)
        v = target(next_obs).gather(1, a_star).squeeze(1)
        return rewards + gamma * (1.0 - terminals) * v


def time_mode(step, batch, seconds):
    for _ in range(10):
        step()
    n = 0
    t0 = time.perf_counter()
    while True:
        step()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds and n >= 10:
            return n * batch / dt, dt / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--modes", default="plain,hooks,ghost")
    ap.add_argument("--hidden", default="256,256")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--noise", type=float, default=0.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    obs_dim, n_actions, gamma, alpha = 8, 4, 0.99, 1.0
    hidden = [int(h) for h in args.hidden.split(",")]
    network = "-".join(str(x) for x in [obs_dim, *hidden, n_actions])
    b = args.batch
    obs = torch.randn(b, obs_dim)
    next_obs = torch.randn(b, obs_dim)
    actions = torch.randint(0, n_actions, (b,))
    rewards = torch.randn(b)
    terminals = (torch.rand(b) < 0.1).float()

    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    base = qnet(obs_dim, hidden, n_actions)
    loader = DataLoader(TensorDataset(obs, actions), batch_size=b)
    for mode in [m for _ in range(args.repeats) for m in args.modes.split(",")]:
        model = copy.deepcopy(base)
        target = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        crit = CqlCriterion(alpha)
        if mode == "hooks":
            model, opt, _ = PrivacyEngine().make_private(
                module=model, optimizer=opt, data_loader=loader,
                noise_multiplier=args.noise, max_grad_norm=1.0, poisson_sampling=False)
        elif mode == "ghost":
            model, opt, crit, _ = PrivacyEngine().make_private(
                module=model, optimizer=opt, data_loader=loader, criterion=crit,
                noise_multiplier=args.noise, max_grad_norm=1.0, poisson_sampling=False,
                grad_sample_mode="ghost")
        elif mode != "plain":
            raise SystemExit(f"unknown mode {mode}")

        def step():
            opt.zero_grad()
            y = double_dqn_target(model, target, rewards, next_obs, terminals, gamma)
            q = model(obs)
            packed = torch.stack([y, actions.float()], dim=1)
            loss = crit(q, packed)
            loss.backward()
            opt.step()

        eps, per_step = time_mode(step, b, args.seconds)
        print(json.dumps({
            "peer": "pytorch" if mode == "plain" else f"opacus-{mode}",
            "case": mode if mode == "plain" or args.noise == 0 else f"{mode}_noise",
            "noise_multiplier": 0.0 if mode == "plain" else args.noise,
            "batch": b, "threads": args.threads, "network": network,
            "params": sum(p.numel() for p in base.parameters()),
            "examples_per_s": eps, "seconds_per_step": per_step,
            "torch": torch.__version__,
        }), flush=True)


if __name__ == "__main__":
    main()
