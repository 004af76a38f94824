"""Policy-export peer: rebuilds fedrl's exported networks in PyTorch from their safetensors files
alone (docs/policy-export.md), plays Gymnasium with them from fixed reset seeds, and compares
the returns with fedrl's own evaluation of the same file on its own simulators.

Not in CI (needs torch and Gymnasium: requirements-torch_policy.txt in .venv, install.sh).
Driven by bench/run_policy_export.sh, which trains the exports first.

Three file kinds, told apart as fedrl tells them apart:
- `policy.safetensors` with `fedrl.model_spec` metadata (task kind dppg): tanh MLP, greedy =
  argmax of the logits (Discrete) or the mean mapped to the action range and clipped to the
  box (Gaussian). Compared with `fedrl eval --policy F --env ID --seed S --episodes N`, whose
  episode i resets with mix(S + i, 0).
- `q_network.safetensors` (`q.0.weight`, no metadata; offline_cql): ReLU MLP, greedy = argmax
  of the Q-values. Compared with the same `fedrl eval`, whose episode i resets with mix(S, i).
- `sac_policy.safetensors` with `fedrl.sac` metadata (primorl): ReLU actor, greedy =
  center + half * tanh(mean). `fedrl eval` does not play it; compared with the run's own final
  evaluation in report.json (the last SAC epoch's, reset seeds 3e9 + policy.seed * 1e4 + k).

Also (`--readme README.md`) runs the README's ~20-line loader on a dppg file and checks its
return against this script's own rebuild at the same reset seed.

Prints one JSON object per comparison (`--json-out` appends them to a file).
"""

import argparse
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

M64 = (1 << 64) - 1
# rl/src/primorl.rs: the policy phase's evaluation episodes reset with this base.
SAC_EVAL_SEED_BASE = 3_000_000_000


def mix(seed: int, k: int) -> int:
    """fedrl_rl::rollout::mix: the SplitMix64 finaliser of seed ^ (k * golden + c)."""
    z = (seed ^ ((k * 0x9E3779B97F4A7C15 + 0xD1B54A32D192ED03) & M64)) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def sequential(tensors: dict, prefix: str, index, act) -> torch.nn.Sequential:
    """An nn.Sequential of Linear layers (activation `act` between them) from the tensors
    `{prefix}.{index(l)}.weight` / `.bias`, l = 0, 1, ... while present."""
    layers = []
    l = 0
    while f"{prefix}.{index(l)}.weight" in tensors:
        w = tensors[f"{prefix}.{index(l)}.weight"]
        b = tensors[f"{prefix}.{index(l)}.bias"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0])
        lin.load_state_dict({"weight": w, "bias": b})
        layers += [lin, act()]
        l += 1
    if not layers:
        raise ValueError(f"no {prefix}.*.weight tensors")
    return torch.nn.Sequential(*layers[:-1]).eval()


class Policy:
    """A greedy actor rebuilt from an exported file: `kind`, `act(obs) -> env action` and the
    number of environment steps each decision is held (`repeat`)."""

    def __init__(self, path: Path):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        t = load_file(str(path))
        self.repeat = 1
        if "fedrl.model_spec" in meta:
            spec = json.loads(meta["fedrl.model_spec"])
            self.kind = "dppg-" + spec["action"]["kind"]
            self.net = sequential(t, "policy", lambda l: 2 * l, torch.nn.Tanh)
            d = spec["obs_dim"]
            self.offset = torch.tensor(spec.get("obs_offset") or [0.0] * d, dtype=torch.float32)
            self.scale = torch.tensor(spec.get("obs_scale") or [1.0] * d, dtype=torch.float32)
            self.low = spec.get("action_low") or []
            self.high = spec.get("action_high") or []
            self.repeat = max(1, spec.get("action_repeat", 1))
        elif "fedrl.sac" in meta:
            m = json.loads(meta["fedrl.sac"])
            self.kind = "sac"
            self.net = sequential(t, "actor", lambda l: 2 * l, torch.nn.ReLU)
            lo = torch.tensor(m["act_low"], dtype=torch.float32)
            hi = torch.tensor(m["act_high"], dtype=torch.float32)
            self.center, self.half = 0.5 * (lo + hi), 0.5 * (hi - lo)
        elif "q.0.weight" in t:
            self.kind = "qnet"
            # Consecutive indices q.0, q.1, ...: ReLU between the layers.
            self.net = sequential(t, "q", lambda l: l, torch.nn.ReLU)
        else:
            raise ValueError(f"{path}: not a fedrl policy export (docs/policy-export.md)")

    @torch.no_grad()
    def act(self, obs, space):
        x = torch.as_tensor(np.asarray(obs, dtype=np.float32))
        if self.kind == "dppg-discrete":
            return int(torch.argmax(self.net((x - self.offset) / self.scale)))
        if self.kind == "qnet":
            return int(torch.argmax(self.net(x)))
        if self.kind == "sac":
            out = self.net(x)
            n = self.half.shape[0]
            a = torch.tanh(out[:n]) * self.half + self.center
            return a.numpy().astype(np.float32)
        a = self.net((x - self.offset) / self.scale)
        if self.low:
            lo = torch.tensor(self.low)
            hi = torch.tensor(self.high)
            a = lo + (a.clamp(-1.0, 1.0) + 1.0) * 0.5 * (hi - lo)
        return np.clip(a.numpy(), space.low, space.high).astype(np.float32)


def play(policy: Policy, env_id: str, reset_seed: int) -> float:
    env = gym.make(env_id)
    obs, _ = env.reset(seed=reset_seed)
    total = 0.0
    while True:
        a = policy.act(obs, env.action_space)
        for _ in range(policy.repeat):
            obs, r, term, trunc, _ = env.step(a)
            total += float(r)
            if term or trunc:
                env.close()
                return total


def reset_seeds(kind: str, seed: int, episodes: int, policy_seed: int) -> list:
    if kind.startswith("dppg"):
        return [mix(seed + i, 0) for i in range(episodes)]
    if kind == "qnet":
        return [mix(seed, i) for i in range(episodes)]
    return [SAC_EVAL_SEED_BASE + policy_seed * 10_000 + k for k in range(episodes)]


def summary(returns) -> dict:
    """Mean, population standard deviation, min and max, summed in episode order as fedrl
    does (numpy's pairwise sums could differ in the last bit from equal returns)."""
    n = len(returns)
    mean = sum(returns) / n
    std = (sum((r - mean) ** 2 for r in returns) / n) ** 0.5
    return {"mean": mean, "std": std, "min": min(returns), "max": max(returns)}


def fedrl_eval(fedrl: str, policy: Path, env: str, seed: int, episodes: int) -> dict:
    out = subprocess.run(
        [fedrl, "eval", "--policy", str(policy), "--env", env, "--seed", str(seed),
         "--episodes", str(episodes), "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    j = json.loads(out.strip().splitlines()[-1])
    return {"mean": j["mean_return"], "std": j["std_return"], "min": j["min_return"],
            "max": j["max_return"]}


def readme_loader(readme: Path) -> str:
    """The README's Python block that loads policy.safetensors (marked by its first line)."""
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    for b in blocks:
        if "fedrl.model_spec" in b:
            return b
    raise ValueError(f"{readme}: no python block reading fedrl.model_spec")


def run_readme(readme: Path, policy_path: Path) -> float:
    """Runs the README loader as a user would (`python loader.py FILE`) and reads its return."""
    code = readme_loader(readme)
    out = subprocess.run([sys.executable, "-c", code, str(policy_path)], check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1].split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", type=Path, required=True, help="exported file")
    ap.add_argument("--env", required=True, help="Gymnasium id (and fedrl simulator id)")
    ap.add_argument("--label", default="", help="name of the case in the output")
    ap.add_argument("--seed", type=int, default=0, help="fedrl eval --seed")
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--fedrl", default="fedrl", help="the fedrl binary")
    ap.add_argument("--run-dir", type=Path, help="SAC: the run directory (report, scenario)")
    ap.add_argument("--readme", type=Path, help="also run this README's loader (dppg only)")
    ap.add_argument("--tolerance", type=float, default=1e-6,
                    help="relative tolerance of 'agree' (max |diff| / max(1, |value|))")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)

    pol = Policy(args.policy)
    row = {"case": args.label or args.policy.parent.name, "file": args.policy.name,
           "kind": pol.kind, "env": args.env, "seed": args.seed}
    if pol.kind == "sac":
        if args.run_dir is None:
            sys.exit("a SAC policy is compared with its run's report: give --run-dir")
        report = json.loads((args.run_dir / "report.json").read_text())["final_evaluation"]
        scen = tomllib.loads((args.run_dir / "scenario.toml").read_text())
        episodes = int(report["final_eval_episodes"])
        pseed = int(scen["task"]["policy"].get("seed", 0))
        seeds = reset_seeds("sac", 0, episodes, pseed)
        fedrl = {"mean": report["final_eval_return"], "std": report["final_eval_return_std"]}
        row["fedrl_source"] = "report.json final_eval_return (the run's last SAC evaluation)"
    else:
        episodes = args.episodes
        seeds = reset_seeds(pol.kind, args.seed, episodes, 0)
        fedrl = fedrl_eval(args.fedrl, args.policy, args.env, args.seed, episodes)
        row["fedrl_source"] = "fedrl eval"
    returns = [play(pol, args.env, s) for s in seeds]
    torch_sum = summary(returns)
    row["episodes"] = episodes
    row["torch"] = {k: torch_sum[k] for k in fedrl}
    row["fedrl"] = fedrl
    diff = max(abs(torch_sum[k] - fedrl[k]) for k in fedrl)
    row["max_abs_diff"] = diff
    row["exact"] = diff == 0.0
    row["agree"] = all(abs(torch_sum[k] - fedrl[k]) <= args.tolerance * max(1.0, abs(fedrl[k]))
                       for k in fedrl)
    if args.readme is not None and pol.kind.startswith("dppg"):
        got = run_readme(args.readme, args.policy)
        want = play(pol, args.env, 0)
        row["readme_loader"] = {"return": got, "peer": want, "agree": got == want}
        row["agree"] = row["agree"] and got == want
    line = json.dumps(row)
    print(line)
    if args.json_out is not None:
        with args.json_out.open("a") as f:
            f.write(line + "\n")
    if not row["agree"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
