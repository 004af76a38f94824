#!/usr/bin/env python3
"""Summarises bench/results/privorl*.jsonl rows: per scenario (and --set overrides), the mean and
the 95% t-interval over runs of utility, fidelity and the membership audit.

    python3 bench/privorl_table.py [--split shuffled] [--since ROWNUMBER] [FILE...]
"""
import argparse
import json
import math
import sys
from collections import OrderedDict

# Two-sided 95% Student t quantiles by degrees of freedom.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def interval(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return f"{m:.3g} (1 run)"
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    h = T95.get(len(xs) - 1, 1.96) * sd / math.sqrt(len(xs))
    return f"{m:.3f} [{m - h:.3f}, {m + h:.3f}]" if abs(m) < 2 else f"{m:.1f} [{m - h:.1f}, {m + h:.1f}]"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="*", default=["bench/results/privorl.jsonl"])
    p.add_argument("--split", default="shuffled", help="rows of this split only ('' for all)")
    p.add_argument("--since", type=int, default=0, help="skip the first N rows of each file")
    a = p.parse_args()
    groups = OrderedDict()
    for f in a.files:
        for i, line in enumerate(open(f)):
            if i < a.since or not line.strip():
                continue
            r = json.loads(line)
            if a.split and r.get("split", "episodes") != a.split:
                continue
            key = (r["scenario"], " ".join(r.get("set", [])))
            groups.setdefault(key, []).append(r)
    print("| scenario | --set | runs | epsilon | utility, % of real | fidelity marginal | fidelity correlation | MIA TPR at 10% FPR |")
    print("| --- | --- | ---: | --- | --- | --- | --- | --- |")
    for (name, sets), rows in groups.items():
        util = [r.get("percent_of_real", r.get("utility_percent_of_real")) for r in rows]
        eps = rows[0]["epsilon"]
        eps = "inf" if eps is None else f"{eps:.2f}"
        print(
            f"| {name} | {sets or '-'} | {len(rows)} | {eps} | {interval(util)} | "
            f"{interval([r['fidelity_marginal'] for r in rows])} | "
            f"{interval([r['fidelity_correlation'] for r in rows])} | "
            f"{interval([r.get('mia_tpr_at_10pct_fpr') for r in rows])} |"
        )


if __name__ == "__main__":
    sys.exit(main())
