#!/usr/bin/env python3
"""Issue 14's result table for one PriMORL task, from the rows the runs appended.

Collects, per variant (high privacy, low privacy, No Privacy, MOPO), one row per released
ensemble: whole `fedrl run` deployments from bench/results/primorl.jsonl (bench/run_primorl.sh)
and policy phases re-run on a released ensemble from bench/results/primorl_policy.jsonl
(target/release/primorl_policy). Only the scenario's own policy settings count (no probes:
penalty weight, rollout length, start fraction, target entropy, uncertainty units as shipped;
MOPO with its 5% real minibatches; rollouts branched from the dataset or the public split as
the scenario says), at the given SAC epochs and round budget. Prints, per
variant, the final normalised return (epoch N) and the mean of the last 5 epochs as mean +- 95%
interval (Student t, n - 1 degrees of freedom), the share of MOPO's mean, and whether the
issue's order MOPO >= No Privacy >= low >= high holds within the intervals. Then the wall-clock
per phase (median over the runs; how many runs shared the 2 cores varies, see bench/README.md).

Usage: python3 bench/primorl_table.py [--task balance] [--epochs 50] [--rounds N]
       python3 bench/primorl_table.py --task pendulum --epochs 15
"""

import argparse
import json
import math
import os
import re
import statistics
import tomllib
from collections import namedtuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ["mopo", "nonprivate", "low", "high"]
# Two-sided 95% Student t quantiles by degrees of freedom (no scipy on a fresh machine).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131}
# The thresholds per task: (epsilon bound, absolute return, share of MOPO).
TARGETS = {"pendulum": (5.1, 700.0, 0.88), "balance": (8.2, 600.0, 0.68),
           "swingup": (17.0, 600.0, 0.77)}
# Policy settings the scenarios ship (a row with any other value is a probe).
SHIPPED = {"lambda": 2.0, "rollout_length": 20, "model_start_fraction": 0.5}
# One released ensemble: final and last-5 normalised return, seconds per phase (None: unknown).
Run = namedtuple("Run", "final last5 model_s policy_s")


def row_starts(r):
    """(data_start_fraction, public_start_fraction) a result row's policy phase branched its
    rollouts with. Rows from before `public_start_fraction` existed carried the public split's
    fraction (the `--public-starts` probe) in data_start_fraction with `public_starts` set."""
    data = r.get("data_start_fraction", 0.0)
    if "public_start_fraction" in r:
        return data, r["public_start_fraction"]
    if r.get("public_starts"):
        return 0.0, data
    return data, 0.0


def shipped_policy(task, variant):
    """The [task.policy] table of the shipped scenario of `variant`."""
    suffix = {"high": "", "low": "-low", "nonprivate": "-nonprivate", "mopo": "-mopo"}[variant]
    with open(os.path.join(ROOT, "scenarios", f"{task}-primorl{suffix}.toml"), "rb") as f:
        return tomllib.load(f)["task"]["policy"]


def shipped_starts(task, variant):
    """(data_start_fraction, public_start_fraction) of the shipped scenario of `variant`."""
    pol = shipped_policy(task, variant)
    return pol.get("data_start_fraction", 0.0), pol.get("public_start_fraction", 0.0)


def shipped_target_entropy(task, variant):
    """SAC's target entropy in the shipped scenario of `variant` (the code's default -3)."""
    return float(shipped_policy(task, variant).get("target_entropy", -3.0))


def variant_of(scenario, task):
    """"high", "low", "nonprivate" or "mopo" for a shipped scenario name of `task`, else None."""
    prefix = f"{task}-primorl"
    if not scenario.startswith(prefix):
        return None
    rest = scenario[len(prefix):]
    return {"": "high", "-low": "low", "-nonprivate": "nonprivate", "-mopo": "mopo"}.get(rest)


def interval(xs):
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def last5(curve):
    return statistics.fmean(v for _, v in curve[-5:])


def shipped_model(task):
    """The shipped high-privacy scenario's clip norm and whether it normalises targets."""
    text = open(os.path.join(ROOT, "scenarios", f"{task}-primorl.toml")).read()
    clip = float(re.search(r"^clip_norm = ([0-9.]+)", text, re.M).group(1))
    return clip, re.search(r"^normalize_targets = true", text, re.M) is not None


def run_tag(r):
    """The run directory name bench/run_primorl.sh gives a primorl.jsonl row's run."""
    tag = f"{r['scenario']}-c{float(r['clip_norm']):g}"
    if r.get("normalize_targets"):
        tag += "-norm"
    if "round_budget" in r:
        tag += f"-r{r['round_budget']}"
    return f"{tag}-e{r['policy_epochs']}-s{r['seed']}"


def model_seconds(res):
    """{run directory name: model-phase seconds} from primorl.jsonl."""
    out = {}
    for line in open(os.path.join(res, "primorl.jsonl")):
        r = json.loads(line)
        if r.get("model_seconds") is not None:
            out.setdefault(run_tag(r), r["model_seconds"])
    return out


def median_seconds(runs, field):
    """Median of one phase's seconds over the runs that recorded it, and how many did."""
    xs = [getattr(run, field) for run in runs.values() if getattr(run, field) is not None]
    return f"{statistics.median(xs):.0f} ({len(xs)})" if xs else "-"


def shipped_rounds(task):
    """The shipped high-privacy scenario's model-phase round budget."""
    with open(os.path.join(ROOT, "scenarios", f"{task}-primorl.toml"), "rb") as f:
        return int(tomllib.load(f)["rounds"])


# Rows and run directories without a round budget ran at 5,000, every task's budget before
# balance and swing-up shipped 1,000 (bench/run_primorl.sh tags every other budget "-r<N>").
UNTAGGED_ROUNDS = 5000


def run_rounds(run):
    """The model-phase round budget a run directory's name records."""
    m = re.search(r"-r(\d+)-", os.path.basename(run))
    return int(m.group(1)) if m else UNTAGGED_ROUNDS


def rows(task, epochs, rounds):
    """{variant: {run directory: Run}}, first matching row per run, for runs whose model phase
    had `rounds` rounds."""
    out = {v: {} for v in VARIANTS}
    clip, norm = shipped_model(task)
    res = os.path.join(ROOT, "bench", "results")
    model_s = model_seconds(res)
    for line in open(os.path.join(res, "primorl.jsonl")):
        r = json.loads(line)
        v = variant_of(r["scenario"], task)
        if v is None or int(r["policy_epochs"]) != epochs or not r.get("curve"):
            continue
        if r.get("round_budget", UNTAGGED_ROUNDS) != rounds or bool(r.get("normalize_targets")) != norm:
            continue
        if abs(float(r["clip_norm"]) - clip) > 1e-12:
            continue
        if row_starts(r) != shipped_starts(task, v):
            continue
        # Rows from before scenarios could set it ran at the default -3.
        if r.get("target_entropy", -3.0) != shipped_target_entropy(task, v):
            continue
        tag = f"{r['scenario']}-s{r['seed']}-run"
        out[v].setdefault(tag, Run(r["final_normalized_return"], last5(r["curve"]),
                                   r.get("model_seconds"), r.get("policy_seconds")))
    for line in open(os.path.join(res, "primorl_policy.jsonl")):
        r = json.loads(line)
        v = variant_of(r["scenario"], task)
        if v is None or int(r["epochs"]) != epochs:
            continue
        # The run directory names the model phase (bench/run_primorl.sh's tag).
        if run_rounds(r["run"]) != rounds or (
                f"-c{clip}" not in r["run"]) or (norm != ("-norm" in r["run"])):
            continue
        if any(abs(float(r[k]) - x) > 1e-12 for k, x in SHIPPED.items()):
            continue
        if r.get("target_entropy", -3.0) != shipped_target_entropy(task, v) or r.get(
                "uncertainty_in_learned_units"):
            continue
        # Rollouts branched from other states than the scenario's (dataset, public split):
        # probes.
        if row_starts(r) != shipped_starts(task, v):
            continue
        if (v == "mopo") != (r["real_ratio"] > 0):
            continue
        out[v].setdefault(r["run"], Run(r["final_normalized_return"], last5(r["curve"]),
                                        model_s.get(os.path.basename(r["run"])),
                                        r.get("seconds")))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="balance", choices=sorted(TARGETS))
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=None,
                    help="model-phase round budget of the runs (default: the scenario's own)")
    a = ap.parse_args()
    if a.rounds is None:
        a.rounds = shipped_rounds(a.task)
    data = rows(a.task, a.epochs, a.rounds)
    _, floor, share = TARGETS[a.task]
    stats = {}
    print(f"{a.task}: {a.epochs} SAC epochs, {a.rounds}-round model budget, normalised return "
          "(final epoch)")
    print("| variant | n | runs (final) | final mean +- 95% | last-5 mean +- 95% | share of MOPO |")
    print("| --- | --- | --- | --- | --- | --- |")
    for v in VARIANTS:
        got = data[v]
        if not got:
            print(f"| {v} | 0 | | | | |")
            continue
        finals = [run.final for run in got.values()]
        fm, fh = interval(finals)
        lm, lh = interval([run.last5 for run in got.values()])
        stats[v] = (fm, fh)
        pct = ""
        if "mopo" in stats and v != "mopo":
            pct = f"{100 * fm / stats['mopo'][0]:.1f}%"
        vals = ", ".join(f"{f:.1f}" for f in finals)
        print(f"| {v} | {len(finals)} | {vals} | {fm:.1f} +- {fh:.1f} | {lm:.1f} +- {lh:.1f} | {pct} |")
    if "high" in stats and "mopo" in stats:
        fm, fh = stats["high"]
        mopo = stats["mopo"][0]
        print(f"- high privacy: {fm:.1f} +- {fh:.1f}; target at least {floor:.0f} and "
              f"{100 * share:.0f}% of MOPO ({share * mopo:.1f}): "
              f"point estimate {'passes' if fm >= max(floor, share * mopo) else 'fails'}, "
              f"lower bound {'passes' if fm - fh >= max(floor, share * mopo) else 'fails'}")
    order = [v for v in VARIANTS if v in stats]
    for hi, lo in zip(order, order[1:]):
        (mh, hh), (ml, hl) = stats[hi], stats[lo]
        # "Holds within the intervals": the higher-ranked variant is not clearly below.
        if math.isnan(hh) or math.isnan(hl):
            verdict = "undetermined (one seed)"
        else:
            verdict = "holds" if mh + hh >= ml - hl else "violated"
        print(f"- {hi} >= {lo} within the intervals: {verdict} ({mh:.1f} against {ml:.1f})")
    print("| variant | model phase s (median, runs with a record) | policy phase s (median) |")
    print("| --- | --- | --- |")
    for v in VARIANTS:
        print(f"| {v} | {median_seconds(data[v], 'model_s')} | {median_seconds(data[v], 'policy_s')} |")
    short = [v for v in VARIANTS if len(data[v]) < 5]
    if short:
        print(f"- fewer than 5 seeds: {', '.join(f'{v} ({len(data[v])})' for v in short)}")


if __name__ == "__main__":
    main()
