"""Physical consistency of PrivORL's synthetic CartPole-v1 transitions (issue 56).

CartPole's dynamics are public and deterministic, so every released transition (s, a, r, s',
terminal) can be checked against them without touching anyone's data: s' should be the Euler
step of Gymnasium's equations from s under action a, and `terminal` should say whether s' left
the bounds (|x| > 2.4 or |theta| > 12 degrees). A downstream CQL learns its values from these
transitions, so a synthesizer whose next states drift from the physics teaches a policy wrong
consequences, however close its marginals are to the real data's.

Reads the Minari folders fedrl writes (the released `OUT/synthetic/privorl/...` of each run, and
optionally the real dataset for the reference) and prints one JSON line per dataset: action
balance, terminal rate, the rate of next states that are out of bounds, how often the terminal
flag agrees, the mean absolute one-step error of each state component, and the run's utility
from its report.json when given a run folder.

    bench/peers/.venv-offline/bin/python bench/peers/privorl_dynamics.py \\
        --real $FEDRL_DATA_DIR/fedrl/cartpole-ppo_mixed-361819d8-v0 /tmp/privorl-bench/cartpole-privorl-*/
"""

import argparse
import glob
import json
import os

import numpy as np
import pyarrow.parquet as pq

# Gymnasium 1.x CartPole-v1 constants (classic_control/cartpole.py), Euler integration.
GRAVITY, MASS_CART, MASS_POLE, HALF_LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
X_LIMIT, THETA_LIMIT = 2.4, 12 * 2 * np.pi / 360


def load(folder):
    """(s, a, s', terminal) of every episode of a Minari folder, stacked."""
    parts = {"s": [], "a": [], "n": [], "t": []}
    for ep in sorted(glob.glob(os.path.join(folder, "data", "*", ""))):
        files = glob.glob(os.path.join(ep, "*.parquet")) + glob.glob(os.path.join(ep, "*.arrow"))
        table = pq.read_table(files[0]).to_pydict()
        obs = np.asarray(table["observations"], dtype=np.float64)
        steps = len(obs) - 1
        parts["s"].append(obs[:-1])
        parts["n"].append(obs[1:])
        parts["a"].append(np.asarray(table["actions"][:steps]))
        parts["t"].append(np.asarray(table["terminations"][:steps], dtype=bool))
    return tuple(np.concatenate(parts[k]) for k in "sant")


def physics(s, a):
    """Gymnasium's CartPole step (Euler) from states s under actions a."""
    x, x_dot, theta, theta_dot = s.T
    force = np.where(a == 1, FORCE, -FORCE)
    cos, sin = np.cos(theta), np.sin(theta)
    total = MASS_CART + MASS_POLE
    pole_ml = MASS_POLE * HALF_LENGTH
    temp = (force + pole_ml * theta_dot**2 * sin) / total
    theta_acc = (GRAVITY * sin - cos * temp) / (
        HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * cos**2 / total)
    )
    x_acc = temp - pole_ml * theta_acc * cos / total
    return np.stack(
        [x + TAU * x_dot, x_dot + TAU * x_acc, theta + TAU * theta_dot, theta_dot + TAU * theta_acc],
        axis=1,
    )


def consistency(s, a, n, t):
    out_of_bounds = (np.abs(n[:, 0]) > X_LIMIT) | (np.abs(n[:, 2]) > THETA_LIMIT)
    error = np.abs(n - physics(s, a)).mean(axis=0)
    return {
        "transitions": int(len(s)),
        "action_1_share": round(float(a.mean()), 4),
        "terminal_rate": round(float(t.mean()), 4),
        "out_of_bounds_rate": round(float(out_of_bounds.mean()), 4),
        "terminal_agrees": round(float((out_of_bounds == t).mean()), 4),
        # Mean |s'_synthetic - step(s, a)| of x, x_dot, theta, theta_dot.
        "one_step_error": [round(float(e), 4) for e in error],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--real", help="a real Minari dataset folder, printed first as the reference")
    p.add_argument("runs", nargs="*", help="fedrl run folders (OUT) of cartpole-privorl scenarios")
    args = p.parse_args()
    if args.real:
        print(json.dumps({"dataset": args.real, **consistency(*load(args.real))}))
    for run in args.runs:
        synthetic = glob.glob(os.path.join(run, "synthetic", "privorl", "*", ""))
        if not synthetic:
            continue
        row = {"run": os.path.basename(os.path.normpath(run))}
        report = os.path.join(run, "report.json")
        if os.path.isfile(report):
            fe = json.load(open(report))["final_evaluation"]
            row["utility_percent_of_real"] = round(fe["utility"]["percent_of_real"], 1)
            row["fidelity_marginal"] = round(fe["fidelity"]["marginal"], 4)
        row.update(consistency(*load(synthetic[0])))
        print(json.dumps(row))


if __name__ == "__main__":
    main()
