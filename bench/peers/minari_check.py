"""Opens a fedrl dataset with Minari and prints what Minari sees, as one JSON object.

    MINARI_DATASETS_PATH is set from DATASET_ROOT; run with the offline venv:
    bench/peers/.venv-offline/bin/python bench/peers/minari_check.py DATASET_ROOT ID

Prints episodes, steps, return quantiles (numpy's linear interpolation, as `fedrl data summary`)
and the unit ids found in the episodes' metadata (Minari's arrow storage keeps per-episode
metadata in `data/<episode>/metadata.json`; fedrl stores the privacy unit there as "unit").
Compare with `fedrl data summary ID --data-dir DATASET_ROOT --json`.
"""

import json
import os
import sys


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} DATASET_ROOT ID")
    root, dataset_id = os.path.abspath(sys.argv[1]), sys.argv[2]
    # Minari reads the variable when it is imported.
    os.environ["MINARI_DATASETS_PATH"] = root
    import minari
    import numpy as np

    ds = minari.load_dataset(dataset_id)
    returns, steps, lengths_ok = [], 0, True
    for ep in ds.iterate_episodes():
        n = len(ep.actions)
        lengths_ok &= (len(ep.observations) == n + 1 and len(ep.rewards) == n
                       and len(ep.terminations) == n and len(ep.truncations) == n)
        steps += n
        returns.append(float(np.sum(ep.rewards)))
    metas = list(ds.storage.get_episode_metadata(ds.episode_indices))
    units = [m.get("unit") for m in metas]
    present = sorted({u for u in units if u is not None})
    r = np.asarray(returns, dtype=np.float64)
    q = (lambda p: float(np.quantile(r, p))) if len(r) else (lambda p: 0.0)
    print(json.dumps({
        "id": ds.spec.dataset_id if hasattr(ds, "spec") else dataset_id,
        "total_episodes": int(ds.total_episodes),
        "total_steps": int(ds.total_steps),
        "episodes": len(returns),
        "steps": steps,
        "lengths_consistent": bool(lengths_ok),
        "observation_space": str(ds.observation_space),
        "action_space": str(ds.action_space),
        "env_spec_id": ds.env_spec.id if ds.env_spec is not None else None,
        "return_mean": float(r.mean()) if len(r) else 0.0,
        "return_min": q(0.0),
        "return_q25": q(0.25),
        "return_median": q(0.5),
        "return_q75": q(0.75),
        "return_max": q(1.0),
        "units": len(present),
        "episodes_without_unit": sum(u is None for u in units),
        "unit_min": present[0] if present else None,
        "unit_max": present[-1] if present else None,
    }))


if __name__ == "__main__":
    main()
