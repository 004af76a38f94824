#!/usr/bin/env python3
"""Issue 13's table: expert-level Selective DP-SGD against its twins, 3 seeds per configuration.

For each environment (cartpole, acrobot, hiv) it runs, with `fedrl run`, variants of the shipped
scenarios `scenarios/<env>-expert*.toml`:
  - `selective`   the shipped scenario (CartPole p = 0.5; Acrobot and HIV p = 0, Table 1);
  - `p=<x>`       the sweep of the probability p of a DP step, x in P_SWEEP, with the release
                  budget of appendix B.3's 3/4 split (epsilon_1 = 7.5, delta_1 = 0.9 delta);
  - `dpsgd`       the expert-level DP-SGD twin (Algorithm 4: no release, p = 1);
  - `nonprivate`  the non-private CQL twin;
  - `<variant>@lr<x>` any of them with learning rate x (e.g. `nonprivate@lr1e-4`);
  - `<variant>@cal=<c>` with the release's epsilon' calibrated by c (`theorem`, `accountant`);
  - `<variant>@rs<x>` with CQL reward scale x (e.g. `nonprivate@rs1e-6`);
  - `<variant>@it<n>` with experts trained n PPO iterations (another cached dataset);
  - `<variant>@cold` with experts that start from their own random weights (no shared start:
                  the scenarios' experts before 2026-12-02, another cached dataset);
  - `<variant>@sh<n>` / `@elr<x>` with experts that start from a shared policy trained n PPO
                  iterations / whose own iterations use Adam learning rate x (another dataset);
  - `<variant>@w<n>` with a Q-network of two hidden layers of n units (the paper's appendix B.3
                  uses (256, 256) on CartPole and Acrobot; the scenarios ship [64, 64]);
  - `<variant>@shared` changes nothing: it names rows of the HIV experts with the shared start
                  (shipped since 2026-12-02), as the untagged HIV rows in expert.jsonl were
                  run with cold-started experts. Acrobot's shared start (shipped later the
                  same day) is named by its fields, `@sh200@elr5e-4`; untagged Acrobot rows
                  are cold-started experts too.
Seeds vary the Q-network's initialisation, the transitions drawn and the step schedule
(`model_seed`, `data_seed`, `schedule_seed`); the experts' dataset is the same (generated once and
cached). Runs use the central update mode (the same accounting and gradients as federated, one
process fewer on the critical path: the bench measures learning, not transport). Noise comes from
the OS (no `seed`), as in a private deployment.

Results are appended to bench/results/expert.jsonl ($EXPERT_RESULTS if set; the rows of the
20-iteration experts of 2026-11-23 are in expert_iter20.jsonl) as each run ends; a rerun skips the runs
already there, so a stopped session resumes. The summary at the end prints mean +- 95% interval
(Student t) of the normalised final return, |D_stable| and the wall-clock of each phase.

Usage: bench/expert_runs.py [--envs cartpole,acrobot] [--variants selective,dpsgd,...]
                            [--seeds 0,1,2] [--steps N] [--summary]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("EXPERT_RESULTS", ROOT / "bench" / "results" / "expert.jsonl"))
OUT = ROOT / "bench" / "results" / "expert"
P_SWEEP = ["0.0", "0.5", "0.8", "0.9"]
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}


def normalise(env, ret):
    """Issue 13's normalisation of a return."""
    if env == "cartpole":
        return ret / 1000.0
    if env == "acrobot":
        return (ret + 200.0) / 200.0
    return ret / 1e6


def variant_text(env, variant, seed, steps):
    """The scenario text of one run."""
    kind, *mods = variant.split("@")
    lr = next((m[2:] for m in mods if m.startswith("lr")), "")
    cal = next((m[4:] for m in mods if m.startswith("cal=")), "")
    rs = next((m[2:] for m in mods if m.startswith("rs")), "")
    it = next((m[2:] for m in mods if m.startswith("it")), "")
    cold = "cold" in mods
    sh = next((m[2:] for m in mods if m.startswith("sh") and m[2:].isdigit()), "")
    elr = next((m[3:] for m in mods if m.startswith("elr")), "")
    width = next((m[1:] for m in mods if m.startswith("w") and m[1:].isdigit()), "")
    base = {
        "selective": f"{env}-expert.toml",
        "dpsgd": f"{env}-expert-dpsgd.toml",
        "nonprivate": f"{env}-expert-nonprivate.toml",
    }.get(kind, f"{env}-expert.toml")
    text = (ROOT / "scenarios" / base).read_text()
    name = f"{env}-{variant}-s{seed}".replace("=", "").replace("@", "-")
    text = re.sub(r'(?m)^name = ".*"$', f'name = "{name}"', text)
    text = re.sub(r'(?m)^mode = ".*"$', 'mode = "central"', text)
    text = text.replace("[task]\n", f"[task]\ndata_seed = {seed}\n", 1)
    text = text.replace("[task.cql]\n", f"[task.cql]\nmodel_seed = {seed}\n", 1)
    if "[task.selective]\n" in text:
        text = text.replace(
            "[task.selective]\n", f"[task.selective]\nschedule_seed = {seed}\n", 1
        )
    if steps:
        text = re.sub(r"(?m)^steps = \d+$", f"steps = {steps}", text)
        text = re.sub(r"(?m)^rounds = \d+$", f"rounds = {steps}", text)
    if lr:
        # `<variant>@lr<x>`: the same run with another learning rate (the twins' tuning).
        text = re.sub(r"(?m)^learning_rate = .*$", f"learning_rate = {lr}", text)
    if width:
        # `<variant>@w<n>`: hidden layers [n, n].
        text = re.sub(r"(?m)^hidden = .*$", f"hidden = [{width}, {width}]", text)
    if rs:
        # `<variant>@rs<x>`: CQL reward scale x (HIV's rewards reach 1e6 per step).
        if re.search(r"(?m)^reward_scale = ", text):
            text = re.sub(r"(?m)^reward_scale = .*$", f"reward_scale = {rs}", text)
        else:
            text = text.replace("[task.cql]\n", f"[task.cql]\nreward_scale = {rs}\n", 1)
    if it:
        # `<variant>@it<n>`: experts trained n PPO iterations each.
        text = re.sub(r"(behaviour = \{.*?[ ,]iterations = )\d+", rf"\g<1>{it}", text)
    if cold:
        text = re.sub(r", (shared_iterations|expert_lr) = [^,}]+", "", text)
    for field, value in (("shared_iterations", sh), ("expert_lr", elr)):
        # `@sh<n>` / `@elr<x>`: experts with a shared start of n iterations / own learning rate x.
        if not value:
            continue
        if re.search(rf"(?m)^behaviour = \{{.*\b{field} = ", text):
            text = re.sub(rf"(?m)^(behaviour = \{{.*\b{field} = )[^,}}]+", rf"\g<1>{value}", text)
        else:
            text = re.sub(r"(?m)^(behaviour = \{.*?)\s*\}$", rf"\1, {field} = {value} }}", text)
    if cal:
        # `<variant>@cal=<theorem|accountant>`: how the release's epsilon' is calibrated.
        text = re.sub(
            r"(?m)^(release = \{.*?)\s*\}$", rf'\1, calibration = "{cal}" }}', text
        )
    if kind.startswith("p="):
        p = kind[2:]
        text = re.sub(
            r"(?m)^unstable_probability = .*$", f"unstable_probability = {p}", text
        )
        text = re.sub(
            r"release = \{ epsilon = [^,]+, delta = [^,]+,",
            "release = { epsilon = 7.5, delta = 0.0003,",
            text,
        )
    return name, text


def done_keys():
    if not RESULTS.exists():
        return set()
    keys = set()
    for line in RESULTS.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            keys.add((r["env"], r["variant"], r["seed"], r["steps"]))
    return keys


def run(fedrl, env, variant, seed, steps):
    name, text = variant_text(env, variant, seed, steps)
    OUT.mkdir(parents=True, exist_ok=True)
    scen = OUT / f"{name}.toml"
    scen.write_text(text)
    out = OUT / name
    subprocess.run(["rm", "-rf", str(out)], check=True)
    p = subprocess.run(
        [fedrl, "run", str(scen), "--out", str(out)], capture_output=True, text=True
    )
    if p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{name} failed")
    rep = json.loads((out / "report.json").read_text())
    op = json.loads((out / "operator" / "report.json").read_text())
    ret = rep["final_evaluation"]["final_eval_return"]
    rel = (rep.get("selective") or {}).get("release") or {}
    row = {
        "env": env,
        "variant": variant,
        "seed": seed,
        "steps": steps,
        "final_return": ret,
        "normalised": normalise(env, ret),
        "epsilon": rep["epsilon"] if isinstance(rep["epsilon"], float) else None,
        "dp_steps": rep["rounds_completed"],
        "stable_transitions": rel.get("stable_transitions"),
        "prefixes_released": rel.get("prefixes_released"),
        "wall_s": rep["wall_seconds"],
        "data_release_s": op["timings"].get("data_release_s"),
        "timings": op["timings"],
    }
    with RESULTS.open("a") as f:
        f.write(json.dumps(row) + "\n")
    subprocess.run(["rm", "-rf", str(out / "operator" / "journal")], check=False)
    print(json.dumps(row), flush=True)


def summary(seeds):
    """The table over the runs of `seeds`."""
    rows = [json.loads(l) for l in RESULTS.read_text().splitlines() if l.strip()]
    rows = [r for r in rows if r["seed"] in seeds]
    print(
        f"\n{'env':<9} {'variant':<11} {'steps':>5} {'n':>2} {'normalised +- 95%':>20} "
        f"{'return':>10} {'eps':>6} {'DP steps':>8} {'|D_st|':>6} {'release s':>9} {'wall s':>7}"
    )
    keys = sorted({(r["env"], r["variant"], r["steps"]) for r in rows})
    for env, variant, steps in keys:
        rs = [r for r in rows if (r["env"], r["variant"], r["steps"]) == (env, variant, steps)]
        x = [r["normalised"] for r in rs]
        m = statistics.mean(x)
        h = (
            T95.get(len(x) - 1, 1.96) * statistics.stdev(x) / len(x) ** 0.5
            if len(x) > 1
            else float("nan")
        )
        ret = statistics.mean(r["final_return"] for r in rs)
        eps = [r["epsilon"] for r in rs if r["epsilon"] is not None]
        st = [r["stable_transitions"] for r in rs if r["stable_transitions"] is not None]
        rel = [r["data_release_s"] for r in rs if r["data_release_s"]]
        print(
            f"{env:<9} {variant:<11} {steps:>5} {len(x):>2} {m:>10.3f} +- {h:<7.3f} {ret:>10.1f} "
            f"{(max(eps) if eps else float('inf')):>6.2f} "
            f"{statistics.mean(r['dp_steps'] for r in rs):>8.0f} "
            f"{(statistics.mean(st) if st else 0):>6.0f} "
            f"{(statistics.mean(rel) if rel else 0):>9.1f} "
            f"{statistics.mean(r['wall_s'] for r in rs):>7.1f}"
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--envs", default="cartpole,acrobot,hiv")
    ap.add_argument(
        "--variants",
        default="selective,dpsgd,nonprivate," + ",".join(f"p={p}" for p in P_SWEEP),
    )
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=0, help="0: the scenario's")
    ap.add_argument("--summary", action="store_true", help="only print the table")
    a = ap.parse_args()
    if not a.summary:
        subprocess.run(
            ["cargo", "build", "--release", "-q", "-p", "fedrl-scenarios"], cwd=ROOT, check=True
        )
        fedrl = str(ROOT / "target" / "release" / "fedrl")
        os.environ.setdefault("FEDRL_DATA_DIR", str(ROOT / "bench" / "results" / "datasets"))
        done = done_keys()
        for env in a.envs.split(","):
            for variant in a.variants.split(","):
                for seed in [int(s) for s in a.seeds.split(",")]:
                    if (env, variant, seed, a.steps) in done:
                        continue
                    print(f"== {env} {variant} seed {seed}", flush=True)
                    run(fedrl, env, variant, seed, a.steps)
    if RESULTS.exists():
        summary([int(s) for s in a.seeds.split(",")])


if __name__ == "__main__":
    main()
