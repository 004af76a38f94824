"""PyTorch peer of fedrl's PrivORL-n synthesizer speed bench (`bench/src/bin/privorl_core.rs`).

The same network, loss, optimiser, EMA and sampler as `fedrl_rl::diffusion`, written from
SynthER's definitions (`conglu1997/SynthER`: `synther/diffusion/denoiser_network.py`
`ResidualMLPDenoiser`, `synther/diffusion/elucidated_diffusion.py` `ElucidatedDiffusion` and its
`Trainer`, `config/resmlp_denoiser.gin`) at fedrl's CPU size:

- denoiser: random Fourier time embedding `[t, sin(2 pi t w), cos(2 pi t w)]` (8 fixed
  frequencies, `learned_sinusoidal_dim = 16`, `random_fourier_features = True`), `time_mlp` =
  Linear(17, 128) - SiLU - Linear(128, 128), `proj` = Linear(d, 128), the residual MLP
  Linear(128, W), L blocks `h + Linear(relu(h))`, `final_linear(relu(h))`; no layer norm
  (gin: `layer_norm = False`); W = 256, L = 4, d = 12: 319,756 trainable parameters (the 8
  frequencies are a frozen parameter, as in SynthER);
- EDM: sigma_data 1, c_skip/c_out/c_in/c_noise of Table 1, ln sigma ~ N(-1.2, 1.2^2), loss
  weight (sigma^2 + 1) / sigma^2, per-row mean squared error, mean over rows;
- AdamW(lr 3e-4, betas (0.9, 0.99), eps 1e-8, weight decay 0), `clip_grad_norm_(1.0)` before
  each step, then the EMA update (ema-pytorch 0.4.2 schedule: beta 0.995, update_every 10,
  update_after_step 100, inv_gamma 1, power 2/3);
- sampler: stochastic Heun, 128 steps, sigma 80 -> 0.002, rho 7, S_churn 80, S_tmin 0.05,
  S_tmax 50, S_noise 1.003, no clamp, drawn from the EMA weights under `torch.no_grad()`.

Optional DP case (`--dp`): the per-example gradients of the same loss with `torch.func`
(`vmap(grad(...))`), each clipped to norm 1, summed, Gaussian noise (z = 1) added, divided by the
batch, and the AdamW + EMA step: a DP-SGD step as Opacus-style code runs it; against the
non-private step of the same batch (`plain_dp_batch`).

Timing: `torch.set_num_threads(--threads)`; warm-up steps and a warm-up sampler call are not
timed; each measurement is the best of `--repeats`. Prints one JSON line (also appended to
`--results`).

    python synther_peer.py --threads 1 [--batches 128,256] [--steps 200] [--samples 2000]
        [--sample-chunk 2000] [--repeats 3] [--dp] [--results bench/results/privorl_core.jsonl]
    python synther_peer.py --check REF.json   # REF from `privorl_core --dump REF.json`

`--check` loads fedrl's initial weights and Fourier frequencies into this network and compares
the network output, the preconditioned denoiser and the per-row EDM losses with fedrl's on the
same rows, noise levels and noise (exit status 1 above a relative 1e-4).
"""

import argparse
import json
import math
import os
import resource
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RandomFourierEmb(nn.Module):
    """SynthER's `RandomOrLearnedSinusoidalPosEmb(dim, is_random=True)`."""

    def __init__(self, dim: int):
        super().__init__()
        self.weights = nn.Parameter(torch.randn(dim // 2), requires_grad=False)

    def forward(self, x):
        x = x[:, None]
        freqs = x * self.weights[None, :] * 2 * math.pi
        return torch.cat((x, freqs.sin(), freqs.cos()), dim=-1)


class ResidualBlock(nn.Module):
    """`x + linear(relu(x))` (SynthER's block with `layer_norm = False`)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + self.linear(F.relu(x))


class ResidualMLP(nn.Module):
    def __init__(self, input_dim: int, width: int, depth: int, output_dim: int):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(input_dim, width),
            *[ResidualBlock(width) for _ in range(depth)],
            nn.Identity(),
        )
        self.final_linear = nn.Linear(width, output_dim)

    def forward(self, x):
        return self.final_linear(F.relu(self.network(x)))


class ResidualMLPDenoiser(nn.Module):
    def __init__(self, d_in: int, dim_t: int = 128, width: int = 256, blocks: int = 4,
                 fourier_dim: int = 16):
        super().__init__()
        self.residual_mlp = ResidualMLP(dim_t, width, blocks, d_in)
        self.proj = nn.Linear(d_in, dim_t)
        self.time_mlp = nn.Sequential(
            RandomFourierEmb(fourier_dim),
            nn.Linear(fourier_dim + 1, dim_t),
            nn.SiLU(),
            nn.Linear(dim_t, dim_t),
        )

    def forward(self, x, t):
        return self.residual_mlp(self.proj(x) + self.time_mlp(t))


# EDM constants (SynthER's gin and `ElucidatedDiffusion` defaults; fedrl's `EdmConfig`).
SIGMA_DATA, P_MEAN, P_STD = 1.0, -1.2, 1.2
SIGMA_MIN, SIGMA_MAX, RHO = 0.002, 80.0, 7.0
STEPS, S_CHURN, S_TMIN, S_TMAX, S_NOISE = 128, 80.0, 0.05, 50.0, 1.003


def denoised(net, x, sigma):
    """EDM's preconditioned `D(x, sigma)`; `sigma` `[B]`."""
    s = sigma[:, None]
    r = (s ** 2 + SIGMA_DATA ** 2)
    c_skip = SIGMA_DATA ** 2 / r
    c_out = s * SIGMA_DATA * r ** -0.5
    c_in = r ** -0.5
    c_noise = torch.log(sigma.clamp(min=1e-20)) * 0.25
    return c_skip * x + c_out * net(c_in * x, c_noise)


def per_row_loss(net, x0, sigma, noise):
    d = denoised(net, x0 + sigma[:, None] * noise, sigma)
    w = (sigma ** 2 + SIGMA_DATA ** 2) * (sigma * SIGMA_DATA) ** -2
    return F.mse_loss(d, x0, reduction="none").mean(dim=1) * w


def draw(b, d):
    sigma = (P_MEAN + P_STD * torch.randn(b)).exp()
    return sigma, torch.randn(b, d)


class Ema:
    """ema-pytorch 0.4.2's schedule with SynthER's trainer settings."""

    def __init__(self, params, beta=0.995, update_every=10, update_after_step=100,
                 inv_gamma=1.0, power=2.0 / 3.0):
        self.params = [p.detach().clone() for p in params]
        self.beta, self.every, self.after = beta, update_every, update_after_step
        self.inv_gamma, self.power = inv_gamma, power
        self.calls = 0

    @torch.no_grad()
    def update(self, online):
        k = self.calls
        self.calls += 1
        if k % self.every != 0:
            return
        if k <= self.after:
            for a, w in zip(self.params, online):
                a.copy_(w)
            return
        e = k - self.after
        decay = min(max(1 - (1 + e / self.inv_gamma) ** -self.power, 0.0), self.beta)
        for a, w in zip(self.params, online):
            a.lerp_(w, 1 - decay)


def schedule():
    inv = 1 / RHO
    i = torch.arange(STEPS, dtype=torch.float32)
    s = (SIGMA_MAX ** inv + i / (STEPS - 1) * (SIGMA_MIN ** inv - SIGMA_MAX ** inv)) ** RHO
    return F.pad(s, (0, 1), value=0.0)


@torch.no_grad()
def heun_sample(net, n, d):
    """SynthER's `ElucidatedDiffusion.sample` (clamp off)."""
    sigmas = schedule()
    gammas = torch.where((sigmas >= S_TMIN) & (sigmas <= S_TMAX),
                         min(S_CHURN / STEPS, math.sqrt(2) - 1), 0.0)
    x = sigmas[0] * torch.randn(n, d)
    for sigma, nxt, gamma in zip(sigmas[:-1].tolist(), sigmas[1:].tolist(), gammas[:-1].tolist()):
        eps = S_NOISE * torch.randn(n, d)
        s_hat = sigma + gamma * sigma
        x_hat = x + math.sqrt(s_hat ** 2 - sigma ** 2) * eps
        d_hat = (x_hat - denoised(net, x_hat, torch.full((n,), s_hat))) / s_hat
        x_next = x_hat + (nxt - s_hat) * d_hat
        if nxt != 0:
            d_next = (x_next - denoised(net, x_next, torch.full((n,), nxt))) / nxt
            x_next = x_hat + 0.5 * (nxt - s_hat) * (d_hat + d_next)
        x = x_next
    return x


def transitions(n):
    """fedrl's bench data (`privorl_core.rs` `transitions`), encoded and standardised."""
    i = torch.arange(n, dtype=torch.float32)
    x = i * 0.013
    s = torch.stack([x.sin() * 0.5, x.cos(), (2 * x).sin() * 0.1, (0.7 * x).cos() * 0.8], 1)
    nxt = s + 0.02 * (torch.arange(4, dtype=torch.float32) - 1.5)
    a = (torch.arange(n) % 3 == 0).long()
    rows = torch.cat([s, F.one_hot(a, 2).float(), torch.ones(n, 1), nxt,
                      ((torch.arange(n) % 50) == 49).float()[:, None]], 1)
    return (rows - rows.mean(0)) / rows.std(0).clamp(min=1e-6)


class Model:
    def __init__(self, d, width, blocks):
        self.net = ResidualMLPDenoiser(d, width=width, blocks=blocks)
        self.params = [p for p in self.net.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=3e-4, betas=(0.9, 0.99), eps=1e-8,
                                     weight_decay=0.0)
        self.ema = Ema(self.params)

    def step_with_grads(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.ema.update(self.params)

    def train_step(self, x0):
        sigma, noise = draw(*x0.shape)
        loss = per_row_loss(self.net, x0, sigma, noise).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.step_with_grads()
        return loss.item()

    def dp_step(self, x0, clip=1.0, z=1.0):
        """Per-example gradients (torch.func), clipped, summed, Gaussian noise, mean, step."""
        from torch.func import functional_call, grad, vmap
        names = [n for n, p in self.net.named_parameters() if p.requires_grad]
        frozen = {n: p for n, p in self.net.named_parameters() if not p.requires_grad}
        params = {n: p.detach() for n, p in zip(names, self.params)}

        def loss_one(p, x, s, e):
            net = lambda xi, ti: functional_call(self.net, {**p, **frozen}, (xi, ti))
            return per_row_loss(net, x[None], s[None], e[None]).sum()

        b = x0.shape[0]
        sigma, noise = draw(*x0.shape)
        g = vmap(grad(loss_one), in_dims=(None, 0, 0, 0))(params, x0, sigma, noise)
        sq = sum(v.reshape(b, -1).pow(2).sum(1) for v in g.values())
        factor = (clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        for n, p in zip(names, self.params):
            s = torch.einsum("b,b...->...", factor, g[n])
            p.grad = (s + z * clip * torch.randn_like(s)) / b
        self.step_with_grads()


def check(path):
    """Loads fedrl's weights from `privorl_core --dump PATH` into this network and recomputes
    `F(x, c_noise)`, `D(x, sigma)` and the per-row EDM losses; returns the largest relative
    differences (the same network computes the same function up to f32 rounding)."""
    with open(path) as f:
        ref = json.load(f)
    d = ref["data_dim"]
    shapes = ref["params"]
    blocks = sum(1 for p in shapes if p["name"].endswith(".linear.weight"))
    width = [p for p in shapes if p["name"] == "residual_mlp.final_linear.weight"][0]["shape"][1]
    net = ResidualMLPDenoiser(d, width=width, blocks=blocks)
    state = net.state_dict()
    flat = torch.tensor(ref["flat"], dtype=torch.float32)
    at = 0
    for p in shapes:
        n = math.prod(p["shape"])
        assert list(state[p["name"]].shape) == p["shape"], p
        state[p["name"]] = flat[at:at + n].reshape(p["shape"])
        at += n
    assert at == flat.numel() == sum(q.numel() for q in net.parameters() if q.requires_grad)
    state["time_mlp.0.weights"] = torch.tensor(ref["freqs"], dtype=torch.float32)
    net.load_state_dict(state)
    x = torch.tensor(ref["rows"], dtype=torch.float32).reshape(-1, d)
    sigma = torch.tensor(ref["sigmas"], dtype=torch.float32)
    noise = torch.tensor(ref["noise"], dtype=torch.float32).reshape(-1, d)

    def rel(a, b):
        b = torch.tensor(b, dtype=torch.float32).reshape(a.shape)
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()

    with torch.no_grad():
        out = {
            "params": at,
            "net_out": rel(net(x, torch.tensor(ref["c_noise"])), ref["net_out"]),
            "denoised": rel(denoised(net, x, sigma), ref["denoised"]),
            "losses": rel(per_row_loss(net, x, sigma, noise), ref["losses"]),
        }
    return out


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def best_rate(repeats, count, fn):
    """Best of `repeats` of `count / seconds(fn)`, and the CPU seconds of that repeat."""
    best, best_cpu = 0.0, None
    for _ in range(repeats):
        c0, t0 = cpu_seconds(), time.perf_counter()
        fn()
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        if count / wall > best:
            best, best_cpu = count / wall, cpu
    return best, best_cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batches", default="128,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--sample-chunk", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sample-repeats", type=int, default=1)
    ap.add_argument("--dp", action="store_true")
    ap.add_argument("--dp-batch", type=int, default=256)
    ap.add_argument("--dp-steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default="bench/results/privorl_core.jsonl")
    ap.add_argument("--check", help="a `privorl_core --dump` file: compare, print, exit")
    a = ap.parse_args()
    if a.check:
        r = check(a.check)
        print(json.dumps({"bench": "synther_peer_check", **r}))
        worst = max(v for k, v in r.items() if k != "params")
        raise SystemExit(0 if worst < 1e-4 else f"fedrl and the peer differ: {r}")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rows = transitions(10_000)
    n, d = rows.shape
    m = Model(d, a.width, a.blocks)
    n_params = sum(p.numel() for p in m.params)
    line = {
        "bench": "privorl_core", "peer": "pytorch", "torch": torch.__version__,
        "device": "cpu", "threads": a.threads, "width": a.width, "blocks": a.blocks,
        "params": n_params,
        "frozen_params": sum(p.numel() for p in m.net.parameters() if not p.requires_grad),
        "data_dim": d, "repeats": a.repeats, "load_avg_1m": os.getloadavg()[0],
    }

    def batch_at(k, b):
        at = (k * b) % (n - b + 1)
        return rows[at:at + b]

    train = {}
    for b in [int(v) for v in a.batches.split(",") if v]:
        for k in range(5):
            m.train_step(batch_at(k, b))

        def run(b=b):
            for k in range(a.steps):
                m.train_step(batch_at(k, b))

        rate, cpu = best_rate(a.repeats, a.steps, run)
        train[str(b)] = {"train_steps_per_s": rate, "train_cpu_s": cpu}
    line["train_steps"] = a.steps
    line["train"] = train
    if a.samples > 0:
        ema_net = ResidualMLPDenoiser(d, width=a.width, blocks=a.blocks)
        ema_net.load_state_dict(m.net.state_dict())
        with torch.no_grad():
            for p, e in zip([p for p in ema_net.parameters() if p.requires_grad], m.ema.params):
                p.copy_(e)
        heun_sample(ema_net, 100, d)

        def sample():
            left = a.samples
            while left > 0:
                k = min(left, a.sample_chunk)
                out = heun_sample(ema_net, k, d)
                assert out.shape == (k, d) and torch.isfinite(out).all()
                left -= k

        rate, cpu = best_rate(a.sample_repeats, a.samples, sample)
        line.update({"sample_steps": STEPS, "samples": a.samples, "sample_chunk": a.sample_chunk,
                     "sampled_transitions_per_s": rate, "sample_cpu_s": cpu})
    if a.dp:
        b = a.dp_batch
        for k in range(3):
            m.dp_step(batch_at(k, b))
            m.train_step(batch_at(k, b))

        def dp():
            for k in range(a.dp_steps):
                m.dp_step(batch_at(k, b))

        def plain():
            for k in range(a.dp_steps):
                m.train_step(batch_at(k, b))

        dp_rate, _ = best_rate(a.repeats, a.dp_steps, dp)
        plain_rate, _ = best_rate(a.repeats, a.dp_steps, plain)
        line["dp"] = {"batch": b, "dp_steps_per_s": dp_rate, "plain_steps_per_s": plain_rate,
                      "dp_over_plain_time": plain_rate / dp_rate, "method": "torch.func vmap(grad)"}
    print(json.dumps(line), flush=True)
    if a.results:
        with open(a.results, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
