#!/usr/bin/env python3
"""dp_accounting 0.6.0 peer of bench/benches/accountants.rs.

Epsilon of T Poisson-sampled Gaussian rounds (z = 1.1, q = 0.004, T = 100 000, delta = 1e-5)
with dp_accounting's PLDAccountant (value_discretization_interval 1e-4, its default) and
RdpAccountant (default orders). Each accountant runs once cold, then --repeats times; prints one
JSON object per accountant and line (the same fields as the Rust bench).
"""
import argparse
import json
import time

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--noise-multiplier", type=float, default=1.1)
    ap.add_argument("--sampling-rate", type=float, default=0.004)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            a.sampling_rate, dp_accounting.GaussianDpEvent(a.noise_multiplier)),
        a.steps)
    makers = {
        "pld": lambda: pld_privacy_accountant.PLDAccountant(
            value_discretization_interval=1e-4),
        "rdp": rdp_privacy_accountant.RdpAccountant,
    }
    for name, make in makers.items():
        def run():
            start = time.perf_counter()
            acc = make()
            acc.compose(event)
            eps = acc.get_epsilon(a.delta)
            return time.perf_counter() - start, eps
        cold, eps = run()
        best = min(run()[0] for _ in range(max(1, a.repeats)))
        print(json.dumps({
            "accountant": name,
            "epsilon": eps,
            "seconds_cold": cold,
            "seconds_min": best,
            "repeats": a.repeats,
            "noise_multiplier": a.noise_multiplier,
            "sampling_rate": a.sampling_rate,
            "steps": a.steps,
            "delta": a.delta,
            "version": "dp_accounting " + getattr(dp_accounting, "__version__", "0.6.0"),
        }), flush=True)


if __name__ == "__main__":
    main()
