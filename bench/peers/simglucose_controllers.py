"""simglucose 0.2.11's own controllers on the patient-days fedrl's `fedrl baseline` ran.

Reads the file `fedrl baseline --dump-meals FILE` writes (per evaluated user: patient, reset
seed, the day's meals as (minute after midnight, g), and PID gains), runs simglucose's
BBController or PIDController in closed loop for one day from 00:00 on the same patient with a
CustomScenario of the same meals (Insulet pump, Dexcom sensor), and writes one JSON line per
patient-day with simglucose's figures on BG: time in 70-180, below 70, below 54, above 180,
above 250 (simglucose's `percent_stats` thresholds) and mean BG.

Sensor: `--noise off` zeroes the Johnson-SU transform of simglucose's Dexcom noise (xi = lambda
= 0), so the CGM reads Gsub exactly; `--noise on` keeps simglucose's Dexcom noise with sensor
seed = the day's reset seed (a different stream from fedrl's, so compare statistically).

Usage: python simglucose_controllers.py --days FILE --controller bb|pid --noise on|off
       [--out FILE]
"""

import argparse
import json
import sys
import time
from datetime import datetime, timedelta

import numpy as np
import pandas as pd
from simglucose.actuator.pump import InsulinPump
from simglucose.controller.basal_bolus_ctrller import BBController
from simglucose.controller.pid_ctrller import PIDController
from simglucose.sensor.cgm import CGMSensor, SENSOR_PARA_FILE
from simglucose.simulation.env import T1DSimEnv
from simglucose.simulation.scenario import CustomScenario
from simglucose.simulation.sim_engine import SimObj
from simglucose.patient.t1dpatient import T1DPatient


def sensor(noise: bool, seed: int) -> CGMSensor:
    params = pd.read_csv(SENSOR_PARA_FILE)
    row = params.loc[params.Name == "Dexcom"].squeeze().copy()
    if not noise:
        # johnson_transform_SU(xi, lambda, ...) = xi + lambda * sinh(...): zero noise.
        row["xi"] = 0.0
        row["lambda"] = 0.0
    return CGMSensor(row, seed=seed)


def stats(bg: np.ndarray) -> dict:
    n = len(bg)
    return {
        "time_in_range": float(((bg >= 70) & (bg <= 180)).sum() / n),
        "time_below_70": float((bg < 70).sum() / n),
        "time_below_54": float((bg < 54).sum() / n),
        "time_above_180": float((bg > 180).sum() / n),
        "time_above_250": float((bg > 250).sum() / n),
        "mean_mg_dl": float(bg.mean()),
    }


def run_day(user: dict, controller: str, noise: bool, target: float) -> dict:
    start = datetime(2018, 1, 1, 0, 0, 0)
    # Meals at the same minute are one meal (fedrl adds them; CustomScenario takes the first).
    meals: dict = {}
    for minute, grams in user["meals"]:
        meals[int(minute)] = meals.get(int(minute), 0.0) + float(grams)
    scenario = CustomScenario(
        start_time=start, scenario=[(m / 60.0, g) for m, g in sorted(meals.items())]
    )
    env = T1DSimEnv(
        T1DPatient.withName(user["patient"]),
        sensor(noise, int(user["seed"]) % (2**32)),
        InsulinPump.withName("Insulet"),
        scenario,
    )
    if controller == "bb":
        ctl = BBController(target=target)
    else:
        g = user["pid_gains"]
        ctl = PIDController(P=g["p"], I=g["i"], D=g["d"], target=target)
    sim = SimObj(env, ctl, timedelta(days=1), animate=False, path=None)
    sim.simulate()
    df = sim.results()
    bg = df["BG"].to_numpy(dtype=float)
    cgm = df["CGM"].to_numpy(dtype=float)
    return {
        "user": user["user"],
        "patient": user["patient"],
        "seed": user["seed"],
        "samples": int(len(bg)),
        "bg": stats(bg),
        "cgm": stats(cgm),
        "insulin_u": float(np.nansum(df["insulin"].to_numpy(dtype=float)) * env.sample_time),
        "carbs_g": float(np.nansum(df["CHO"].to_numpy(dtype=float)) * env.sample_time),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", required=True, help="fedrl baseline --dump-meals output")
    ap.add_argument("--controller", choices=["bb", "pid"], required=True)
    ap.add_argument("--noise", choices=["on", "off"], required=True)
    ap.add_argument("--out", help="JSON lines (default: stdout)")
    args = ap.parse_args()
    with open(args.days) as f:
        days = json.load(f)
    target = float(days.get("pid_target_mg_dl", 140.0))
    out = open(args.out, "w") if args.out else sys.stdout
    t0 = time.time()
    for user in days["users"]:
        rec = run_day(user, args.controller, args.noise == "on", target)
        rec["controller"] = args.controller
        rec["noise"] = args.noise
        out.write(json.dumps(rec) + "\n")
        out.flush()
    print(f"{len(days['users'])} days in {time.time() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
