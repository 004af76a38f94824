"""Opens a fedrl run's TensorBoard event files with TensorBoard's own reader and checks that its
scalars are exactly the numbers of the run's public metrics.jsonl.

    bench/peers/.venv/bin/python bench/peers/tensorboard_read.py OUT

OUT is a `fedrl run` output folder (or an aggregator state directory): the event files are in
OUT/tensorboard/, the lines in OUT/metrics.jsonl. TensorBoard's EventAccumulator reads the
directory (every event file in it, in name order, as `tensorboard --logdir` does); each tag's
scalars must equal, step for step, the field of the released lines the tag names
(`eval/eval_return` is `line["eval"]["eval_return"]`), as float32, and no released line's
number (but the round, which is the step, and the time `t_s`, which is left out) may be
missing from TensorBoard.

One caveat, by design: the aggregator writes each line's event as the line is written, when a
row between two accounted epsilons has none yet; `fedrl run` later fills those rows' epsilon
in metrics.jsonl (marked `"epsilon_exact": false`). The `epsilon` tag therefore holds the rows
with `epsilon_exact` true (or absent), and the filled ones are reported, not compared.

Prints one JSON object (tags, points compared, mismatches); exits 1 on any mismatch.
"""

import json
import math
import os
import struct
import sys


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def leaves(prefix: str, v, out: dict) -> None:
    """Numbers of a JSON line by TensorBoard tag (the writer's rule: every number but `round`
    and the time `t_s`)."""
    if isinstance(v, dict):
        for k, x in v.items():
            leaves(f"{prefix}/{k}" if prefix else k, x, out)
    elif isinstance(v, bool) or v is None or isinstance(v, (str, list)):
        return
    elif isinstance(v, (int, float)):
        out[prefix] = float(v)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT")
    out = os.path.abspath(sys.argv[1])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # size_guidance 0: keep every scalar (the default keeps a reservoir sample of 10,000).
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tb = {}
    for tag in acc.Tags()["scalars"]:
        tb[tag] = {e.step: e.value for e in acc.Scalars(tag)}

    want, filled = {}, 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("status") != "released":
                continue
            nums = {}
            leaves("", row, nums)
            nums.pop("round", None)
            nums.pop("t_s", None)
            if row.get("epsilon_exact") is False:
                nums.pop("epsilon", None)
                filled += 1
            for tag, v in nums.items():
                want.setdefault(tag, {})[row["round"]] = f32(v)

    mismatches = []
    for tag in sorted(set(tb) | set(want)):
        got, exp = tb.get(tag, {}), want.get(tag, {})
        for step in sorted(set(got) | set(exp)):
            g, e = got.get(step), exp.get(step)
            same = g is not None and e is not None and (g == e or (math.isnan(g) and math.isnan(e)))
            if not same:
                mismatches.append({"tag": tag, "step": step, "tensorboard": g, "metrics_jsonl": e})
    report = {
        "event_files": sorted(os.listdir(os.path.join(out, "tensorboard"))),
        "tags": {tag: len(v) for tag, v in sorted(tb.items())},
        "points_compared": sum(len(v) for v in want.values()),
        "epsilon_rows_filled_after_the_run": filled,
        "mismatches": mismatches[:20],
        "mismatch_count": len(mismatches),
    }
    print(json.dumps(report, indent=1))
    sys.exit(1 if mismatches or not want else 0)


if __name__ == "__main__":
    main()
