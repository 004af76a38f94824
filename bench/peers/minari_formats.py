"""Minari-formats peer (issue 58, "Checked by"): Python minari writes the same small CartPole
dataset in each of its storage formats, fedrl imports each, and d3rlpy loads a dataset fedrl
wrote, as it is. Prints one JSON object (also written to --out).

    bench/peers/.venv-offline/bin/python bench/peers/minari_formats.py \
        --root ROOT --fedrl path/to/fedrl [--episodes 40] [--seed 0] [--cql-steps 2000]

Not in CI (needs minari[create] with jax, h5py and d3rlpy: requirements-offline.txt and
requirements-minari_formats.txt in .venv-offline). Driven by bench/run_minari_formats.sh.

1. Writes `peer/cartpole-random-{hdf5,arrow,parquet}-v0` under ROOT (MINARI_DATASETS_PATH) with
   `minari.DataCollector(env, data_format=...)`: the same episodes in each (reset seeds
   seed + i, uniformly random actions from a generator seeded with `seed`), then gives every
   two episodes one privacy unit through Minari's own `update_episode_metadata` (key "unit").
2. `fedrl data import` of each (into `peer/imported-<format>-v0` under the same root), with
   `--json`; the import's summary (episodes, steps, units, return mean) is compared with what
   Python wrote. An import that fails is reported with its message (the HDF5 one without the
   `hdf5` feature).
3. A short non-private `fedrl cql` on the imported parquet dataset, and a short private DP-SGD
   CQL run (`fedrl run scenarios/cartpole-cql-dpsgd.toml` with `[task.dataset]` naming the
   imported dataset, units = "stored": Minari's "unit" episode metadata) on each format that
   imported.
4. `fedrl data generate` a small CartPole dataset, then builds d3rlpy's `MDPDataset` from it
   with Minari's own flags unchanged (terminals = terminations, timeouts = truncations), no
   workaround: counts the steps with both flags and the episodes that end on neither (the two
   cases d3rlpy rejects or mis-splits), and checks d3rlpy's episode and transition counts.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

FORMATS = ("hdf5", "arrow", "parquet")


def run(cmd, env=None):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    return p.returncode, p.stdout, p.stderr


def write_datasets(episodes: int, seed: int) -> dict:
    """Records the episodes once per format; returns what was written (per format)."""
    import gymnasium as gym
    import minari
    import numpy as np
    from minari import DataCollector

    written = {}
    for fmt in FORMATS:
        dataset_id = f"peer/cartpole-random-{fmt}-v0"
        try:
            minari.delete_dataset(dataset_id)
        except Exception:  # not there yet
            pass
        env = DataCollector(gym.make("CartPole-v1"), data_format=fmt)
        rng = np.random.default_rng(seed)
        returns, steps = [], 0
        for i in range(episodes):
            env.reset(seed=seed + i)
            total, done = 0.0, False
            while not done:
                _, r, term, trunc, _ = env.step(int(rng.integers(2)))
                total += float(r)
                steps += 1
                done = term or trunc
            returns.append(total)
        ds = env.create_dataset(dataset_id=dataset_id, algorithm_name="uniform random",
                                description="fedrl peer: one dataset, three storage formats")
        env.close()
        # Two episodes per privacy unit, through Minari's own per-episode metadata.
        ds.storage.update_episode_metadata([{"unit": i // 2} for i in range(episodes)],
                                           range(episodes))
        back = minari.load_dataset(dataset_id)
        data_dir = Path(os.environ["MINARI_DATASETS_PATH"]) / dataset_id / "data"
        written[fmt] = {
            "id": dataset_id,
            "episodes": int(back.total_episodes),
            "steps": int(back.total_steps),
            "units": len({i // 2 for i in range(episodes)}),
            "return_mean": float(np.mean(returns)),
            "files": sorted(p.name for p in data_dir.iterdir())[:4],
        }
        assert steps == written[fmt]["steps"], (fmt, steps, written[fmt])
    return written


def import_all(fedrl: str, root: Path, written: dict) -> dict:
    out = {}
    for fmt, w in written.items():
        target = f"peer/imported-{fmt}-v0"
        rc, stdout, stderr = run([fedrl, "data", "import", w["id"], "--id", target,
                                  "--data-dir", root, "--json"])
        row = {"rc": rc}
        if rc == 0:
            j = json.loads(stdout.strip().splitlines()[-1])
            s = j["summary"]
            row.update(id=j["id"], units_assigned=j["units_assigned"], summary=s)
            row["matches"] = _matches(s, w)
        else:
            row["error"] = stderr.strip()
        out[fmt] = row
    # The same episodes in three formats: fedrl's summaries (counts, units, every return
    # quantile) must be the same but for the id.
    sums = [{k: v for k, v in r["summary"].items() if k != "id"}
            for r in out.values() if r["rc"] == 0]
    out["summaries_identical_across_formats"] = len(sums) > 1 and all(x == sums[0] for x in sums)
    return out


def _matches(summary: dict, written: dict) -> dict:
    """fedrl's summary against what Python wrote, field by field (True where equal)."""
    def first(*keys):
        for k in keys:
            if k in summary:
                return summary[k]
        return None
    got = {
        "episodes": first("episodes"),
        "steps": first("steps", "transitions"),
        "units": first("units"),
        "return_mean": first("return_mean", "mean_return"),
    }
    return {k: {"fedrl": v, "python": written[k],
                "equal": v is not None and abs(float(v) - float(written[k])) < 1e-9}
            for k, v in got.items()}


def cql(fedrl: str, root: Path, dataset_id: str, steps: int) -> dict:
    rc, stdout, stderr = run([fedrl, "cql", dataset_id, "--data-dir", root, "--steps", steps,
                              "--eval-episodes", 20, "--json"])
    if rc != 0:
        return {"rc": rc, "error": stderr.strip()[-2000:]}
    return {"rc": 0, **json.loads(stdout.strip().splitlines()[-1])}


def private_cql(fedrl: str, root: Path, dataset_id: str, units: int, rounds: int) -> dict:
    """A short private DP-SGD CQL run on an imported dataset by name: its report's epsilon and
    final return."""
    out = root / "runs" / dataset_id.replace("/", "-")
    scenario = Path(__file__).resolve().parents[2] / "scenarios" / "cartpole-cql-dpsgd.toml"
    sets = {
        "task.dataset": f'{{ name = "{dataset_id}", units = "stored" }}',
        "unit_kind": "user",
        "users": units,
        "client_agents": 1,
        "rounds": rounds,
        "participation": '{ kind = "sampled", rate = 0.25 }',
        "task.eval_every": max(1, rounds // 2),
    }
    cmd = [fedrl, "run", scenario, "--out", out]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = dict(os.environ, FEDRL_DATA_DIR=str(root))
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        return {"rc": p.returncode, "error": p.stderr.strip()[-2000:]}
    report = json.loads((out / "report.json").read_text())
    return {"rc": 0, "dataset": dataset_id, "rounds": report.get("rounds"),
            "epsilon": report.get("epsilon"), "delta": report.get("delta"),
            "final_eval_return": report["final_evaluation"].get("final_eval_return")}


def d3rlpy_as_is(fedrl: str, root: Path, units: int) -> dict:
    import d3rlpy
    import minari
    import numpy as np

    rc, stdout, stderr = run([fedrl, "data", "generate", "--env", "CartPole-v1", "--units", units,
                              "--iterations", 20, "--data-dir", root, "--json"])
    if rc != 0:
        return {"rc": rc, "error": stderr.strip()[-2000:]}
    dataset_id = json.loads(stdout.strip().splitlines()[-1])["id"]
    ds = minari.load_dataset(dataset_id)
    obs, acts, rews, terms, truncs = [], [], [], [], []
    both_steps = neither_end = truncated_end = 0
    for ep in ds.iterate_episodes():
        te = np.asarray(ep.terminations, dtype=bool)
        tr = np.asarray(ep.truncations, dtype=bool)
        both_steps += int(np.sum(te & tr))
        neither_end += int(not (te[-1] or tr[-1]))
        truncated_end += int(tr[-1] and not te[-1])
        # Minari keeps steps + 1 observations, d3rlpy one per step.
        obs.append(np.asarray(ep.observations[:-1], dtype=np.float32))
        acts.append(np.asarray(ep.actions, dtype=np.int64))
        rews.append(np.asarray(ep.rewards, dtype=np.float32))
        terms.append(te.astype(np.float32))
        truncs.append(tr.astype(np.float32))
    row = {"id": dataset_id, "episodes": int(ds.total_episodes), "steps": int(ds.total_steps),
           "steps_terminated_and_truncated": both_steps,
           "episodes_ending_on_neither": neither_end, "episodes_truncated": truncated_end}
    try:
        mdp = d3rlpy.dataset.MDPDataset(
            observations=np.concatenate(obs), actions=np.concatenate(acts),
            rewards=np.concatenate(rews), terminals=np.concatenate(terms),
            timeouts=np.concatenate(truncs), action_space=d3rlpy.ActionSpace.DISCRETE,
            action_size=int(ds.action_space.n))
        row.update(d3rlpy_loaded=True, d3rlpy_episodes=len(mdp.episodes),
                   d3rlpy_transitions=int(mdp.transition_count))
        # d3rlpy counts a timed-out episode's last step as no transition (it has no next
        # observation to bootstrap from): steps - truncated episodes.
        row["counts_agree"] = (row["d3rlpy_episodes"] == row["episodes"]
                               and row["d3rlpy_transitions"] == row["steps"] - truncated_end)
    except Exception as e:  # what d3rlpy says, reported as is
        row.update(d3rlpy_loaded=False, d3rlpy_error=f"{type(e).__name__}: {e}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="MINARI_DATASETS_PATH and --data-dir")
    ap.add_argument("--fedrl", required=True, help="the fedrl binary")
    ap.add_argument("--episodes", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cql-steps", type=int, default=2000)
    ap.add_argument("--d3rlpy-units", type=int, default=500)
    ap.add_argument("--private-rounds", type=int, default=100)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    # Minari reads the variable when it is imported.
    os.environ["MINARI_DATASETS_PATH"] = str(root)
    import minari
    import d3rlpy
    import h5py
    import jax

    # minari, jax and d3rlpy log to stdout; stdout carries only the result.
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    written = write_datasets(args.episodes, args.seed)
    imported = import_all(args.fedrl, root, written)
    cql_row = cql(args.fedrl, root, "peer/imported-parquet-v0", args.cql_steps) \
        if imported["parquet"]["rc"] == 0 else {"skipped": "parquet import failed"}
    cql_row["note"] = "non-private `fedrl cql` (d3rlpy's defaults)"
    private = {}
    for fmt, row in imported.items():
        if not isinstance(row, dict) or row.get("rc") != 0:
            continue
        private[fmt] = private_cql(args.fedrl, root, f"peer/imported-{fmt}-v0",
                                   written[fmt]["units"], args.private_rounds)
    d3 = d3rlpy_as_is(args.fedrl, root, args.d3rlpy_units)
    sys.stdout = real_stdout
    result = {
        "versions": {"minari": minari.__version__, "d3rlpy": d3rlpy.__version__,
                     "h5py": h5py.__version__, "jax": jax.__version__},
        "written": written,
        "imported": imported,
        "cql_on_imported_parquet": cql_row,
        "private_cql_on_imported": private,
        "d3rlpy_on_fedrl_dataset": d3,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
