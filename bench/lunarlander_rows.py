#!/usr/bin/env python3
"""Issue 57's LunarLander table: JSON rows and the summary of a `fedrl run --replicates`.

`fedrl run scenarios/lunarlander-expert.toml --replicates N --twin
scenarios/lunarlander-expert-dpsgd.toml --twin scenarios/lunarlander-expert-nonprivate.toml
--out OUT` leaves OUT/rep-i (Selective DP-SGD) and OUT/rep-i/twin, OUT/rep-i/twin-2 (the DP-SGD
and non-private twins). This reads every finished run's public report (and the operator's
timings), appends one row per run to bench/results/lunarlander_expert.jsonl (the fields of
bench/results/expert.jsonl, `env` = "lunarlander") and prints mean +- 95% interval (Student t)
of the final return per variant.

Usage: bench/lunarlander_rows.py OUT [--append]
"""

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "lunarlander_expert.jsonl"
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}
ARMS = {"": "selective", "twin": "dpsgd", "twin-2": "nonprivate"}


def row(run: Path, variant: str, seed: int):
    rep = json.loads((run / "report.json").read_text())
    op = json.loads((run / "operator" / "report.json").read_text())
    fe = rep["final_evaluation"]
    if "final_eval_return" not in fe:
        return None
    rel = (rep.get("selective") or {}).get("release") or {}
    return {
        "env": "lunarlander",
        "variant": variant,
        "seed": seed,
        "final_return": fe["final_eval_return"],
        "final_return_std": fe.get("final_eval_return_std"),
        "episodes": fe.get("final_eval_episodes"),
        "epsilon": rep["epsilon"] if isinstance(rep["epsilon"], float) else None,
        "dp_steps": rep["rounds_completed"],
        "stable_transitions": rel.get("stable_transitions"),
        "prefixes_released": rel.get("prefixes_released"),
        "wall_s": rep["wall_seconds"],
        "data_release_s": op.get("timings", {}).get("data_release_s"),
        "timings": op.get("timings"),
    }


def main():
    out = Path(sys.argv[1])
    rows = []
    for rep_dir in sorted(out.glob("rep-*")):
        seed = int(rep_dir.name.split("-")[1])
        for sub, variant in ARMS.items():
            run = rep_dir / sub if sub else rep_dir
            if (run / "report.json").exists() and (run / "operator" / "report.json").exists():
                r = row(run, variant, seed)
                if r:
                    rows.append(r)
    if "--append" in sys.argv:
        with RESULTS.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"{'variant':<11} {'n':>2} {'return +- 95%':>18} {'eps':>6} {'DP steps':>8} {'|D_st|':>6} {'wall s':>7}")
    for variant in ARMS.values():
        rs = [r for r in rows if r["variant"] == variant]
        if not rs:
            continue
        v = [r["final_return"] for r in rs]
        m = statistics.mean(v)
        half = T95[len(v) - 1] * statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else float("nan")
        eps = max((r["epsilon"] or float("inf")) for r in rs)
        st = statistics.mean([r["stable_transitions"] or 0 for r in rs])
        wall = statistics.mean([r["wall_s"] for r in rs])
        dp = statistics.mean([r["dp_steps"] for r in rs])
        print(f"{variant:<11} {len(v):>2} {m:>9.1f} +- {half:>6.1f} {eps:>6.2f} {dp:>8.0f} {st:>6.0f} {wall:>7.1f}")


if __name__ == "__main__":
    main()
