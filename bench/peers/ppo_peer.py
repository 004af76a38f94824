#!/usr/bin/env python3
"""Non-private peer: CleanRL-style PPO (ppo.py defaults) on Gymnasium CartPole-v1, CPU.

Reports the wall-clock to a mean return >= --target over 100 held-out evaluation episodes
(greedy actions, seeds never used in training), the env steps it took, and env-steps/s.
Evaluation runs when the mean of the last 20 training episodes reaches the target (plus every
--eval-every updates); its time is counted in the wall-clock. Prints one JSON line at the end.
"""
import argparse
import json
import time

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
from torch.distributions.categorical import Categorical


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=64):
        super().__init__()
        self.value = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, 1), std=1.0),
        )
        self.policy = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, n_actions), std=0.01),
        )

    def get_value(self, x):
        return self.value(x)

    def get_action_and_value(self, x, action=None):
        logits = self.policy(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.value(x)


def evaluate(agent, episodes=100, seed=10_000_000):
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(episodes)])
    obs, _ = envs.reset(seed=seed)
    done = np.zeros(episodes, dtype=bool)
    ret = np.zeros(episodes)
    while not done.all():
        with torch.no_grad():
            a = agent.policy(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()
        obs, r, term, trunc, _ = envs.step(a)
        ret += r * (~done)
        done |= term | trunc
    envs.close()
    return float(ret.mean())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=500_000)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--target", type=float, default=475.0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    batch = a.num_envs * a.num_steps
    mb = batch // a.num_minibatches
    updates = a.total_timesteps // batch

    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(a.num_envs)])
    agent = Agent(4, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=a.lr, eps=1e-5)
    obs_b = torch.zeros((a.num_steps, a.num_envs, 4))
    act_b = torch.zeros((a.num_steps, a.num_envs))
    logp_b = torch.zeros((a.num_steps, a.num_envs))
    rew_b = torch.zeros((a.num_steps, a.num_envs))
    done_b = torch.zeros((a.num_steps, a.num_envs))
    val_b = torch.zeros((a.num_steps, a.num_envs))

    start = time.time()
    steps = 0
    next_obs, _ = envs.reset(seed=a.seed)
    next_obs = torch.as_tensor(next_obs, dtype=torch.float32)
    next_done = torch.zeros(a.num_envs)
    ep_ret = np.zeros(a.num_envs)
    recent = []
    result = None
    last_eval = None
    for update in range(1, updates + 1):
        frac = 1.0 - (update - 1.0) / updates
        opt.param_groups[0]["lr"] = frac * a.lr
        for t in range(a.num_steps):
            steps += a.num_envs
            obs_b[t] = next_obs
            done_b[t] = next_done
            with torch.no_grad():
                action, logp, _, value = agent.get_action_and_value(next_obs)
            val_b[t] = value.flatten()
            act_b[t] = action
            logp_b[t] = logp
            o, r, term, trunc, _ = envs.step(action.numpy())
            ep_ret += r
            for i in np.nonzero(term | trunc)[0]:
                recent.append(ep_ret[i])
                ep_ret[i] = 0
            # CleanRL's simplification: truncation treated as termination.
            next_done = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32)
            rew_b[t] = torch.as_tensor(r, dtype=torch.float32)
            next_obs = torch.as_tensor(o, dtype=torch.float32)
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            adv = torch.zeros_like(rew_b)
            last = 0
            for t in reversed(range(a.num_steps)):
                if t == a.num_steps - 1:
                    nnt, nv = 1.0 - next_done, next_value
                else:
                    nnt, nv = 1.0 - done_b[t + 1], val_b[t + 1]
                delta = rew_b[t] + a.gamma * nv * nnt - val_b[t]
                adv[t] = last = delta + a.gamma * a.gae_lambda * nnt * last
            ret = adv + val_b
        b_obs, b_act, b_logp = obs_b.reshape(-1, 4), act_b.reshape(-1), logp_b.reshape(-1)
        b_adv, b_ret = adv.reshape(-1), ret.reshape(-1)
        idx = np.arange(batch)
        for _ in range(a.update_epochs):
            np.random.shuffle(idx)
            for s in range(0, batch, mb):
                m = idx[s:s + mb]
                _, newlogp, ent, newv = agent.get_action_and_value(b_obs[m], b_act.long()[m])
                ratio = (newlogp - b_logp[m]).exp()
                madv = b_adv[m]
                madv = (madv - madv.mean()) / (madv.std() + 1e-8)
                pg = torch.max(-madv * ratio, -madv * torch.clamp(ratio, 1 - a.clip_coef, 1 + a.clip_coef)).mean()
                vloss = 0.5 * ((newv.view(-1) - b_ret[m]) ** 2).mean()
                loss = pg - a.ent_coef * ent.mean() + vloss * a.vf_coef
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), a.max_grad_norm)
                opt.step()
        rolling = np.mean(recent[-20:]) if recent else 0.0
        if rolling >= a.target or update % a.eval_every == 0:
            last_eval = evaluate(agent)
            print(f"update {update} steps {steps} train(last20) {rolling:.1f} eval {last_eval:.1f} "
                  f"t {time.time() - start:.1f}s", flush=True)
            if last_eval >= a.target:
                result = {"solved": True, "wall_clock_s": time.time() - start, "env_steps": steps}
                break
    elapsed = time.time() - start
    if result is None:
        result = {"solved": False, "wall_clock_s": elapsed, "env_steps": steps, "last_eval": last_eval}
    result.update({"peer": "cleanrl-ppo-torch", "torch": torch.__version__, "threads": a.threads,
                   "env_steps_per_s": steps / elapsed, "seed": a.seed})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
