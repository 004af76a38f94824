"""The worker, driven as the Rust side drives it: a subprocess spoken to over its pipes."""

import json
import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fedrl_bridge import protocol as p  # noqa: E402


class Client:
    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fedrl_bridge.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )

    def ask(self, t, n, payload=b""):
        self.proc.stdin.write(p.pack(t, n, payload))
        self.proc.stdin.flush()
        return p.read_frame(self.proc.stdout)

    def init(self, env_id, module=None, probe_kwargs=None):
        req = {"env_id": env_id, "module": module, "probe_kwargs": probe_kwargs or {}}
        t, _, payload = self.ask(p.INIT, 0, json.dumps(req).encode())
        return t, payload

    def make(self, kws):
        return self.ask(p.MAKE, len(kws), json.dumps(kws).encode())

    def reset(self, slots, seeds):
        pl = np.asarray(slots, "<i8").tobytes() + np.asarray(seeds, "<u8").tobytes()
        return self.ask(p.RESET, len(slots), pl)

    def step_discrete(self, slots, actions):
        pl = np.asarray(slots, "<i8").tobytes() + np.asarray(actions, "<i8").tobytes()
        return self.ask(p.STEP, len(slots), pl)

    def close(self):
        self.proc.stdin.close()
        return self.proc.wait(timeout=10)


@pytest.fixture
def client():
    c = Client()
    yield c
    if c.proc.poll() is None:
        c.proc.kill()
        c.proc.wait()


def split_step(payload, n, obs_dim):
    o = 4 * n * obs_dim
    obs = np.frombuffer(payload[:o], "<f4").reshape(n, obs_dim)
    rew = np.frombuffer(payload[o : o + 8 * n], "<f8")
    term = np.frombuffer(payload[o + 8 * n : o + 9 * n], "u1")
    trunc = np.frombuffer(payload[o + 9 * n : o + 10 * n], "u1")
    return obs, rew, term, trunc


def test_cartpole_spaces_and_episodes_match_gymnasium(client):
    t, payload = client.init("CartPole-v1")
    assert t == p.SPACES
    spaces = json.loads(payload)
    assert spaces["observation"]["kind"] == "box" and spaces["observation"]["shape"] == [4]
    assert spaces["action"] == {"kind": "discrete", "n": 2, "start": 0}
    assert spaces["protocol"] == p.VERSION
    assert client.make([{}, {}, {}])[:2] == (p.OK, 3)
    seeds = [1, 2**63 + 5, 42]
    t, n, obs = client.reset([0, 1, 2], seeds)
    assert (t, n) == (p.OBS, 3)
    obs = np.frombuffer(obs, "<f4").reshape(3, 4)
    refs = [gym.make("CartPole-v1") for _ in seeds]
    for i, (r, s) in enumerate(zip(refs, seeds)):
        o, _ = r.reset(seed=s)
        np.testing.assert_array_equal(obs[i], o)
    rng = np.random.default_rng(0)
    for _ in range(8):
        acts = rng.integers(0, 2, size=3)
        t, n, pl = client.step_discrete([0, 1, 2], acts)
        assert t == p.STEP_RESULT
        o, rew, te, tr = split_step(pl, 3, 4)
        for i, r in enumerate(refs):
            ro, rr, rte, rtr, _ = r.step(int(acts[i]))
            np.testing.assert_array_equal(o[i], ro)
            assert rew[i] == rr and bool(te[i]) == rte and bool(tr[i]) == rtr
    # CLOSE: no reply, the worker exits 0.
    assert client.ask(p.CLOSE, 0) is None
    assert client.proc.wait(timeout=10) == 0


def test_own_env_per_user_kwargs_and_errors_keep_the_worker(client):
    t, payload = client.init("FedrlTest/Misbehave-v0", module="fedrl_bridge.test_envs")
    assert t == p.SPACES, payload
    assert client.make([{"scale": 2.0, "mode": "raise", "at_step": 2}, {"scale": 3.0}])[1] == 2
    t, _, obs = client.reset([0, 1], [0, 0])
    obs = np.frombuffer(obs, "<f4").reshape(2, 3)
    assert obs[0, 1] == 2.0 and obs[1, 1] == 3.0
    t, _, pl = client.step_discrete([0, 1], [1, 1])
    _, rew, _, _ = split_step(pl, 2, 3)
    assert list(rew) == [2.0, 3.0]
    t, _, msg = client.step_discrete([0, 1], [1, 1])
    assert t == p.ERROR and b"misbehaving on purpose" in msg
    # Still serving after an error.
    t, _, _ = client.reset([1], [7])
    assert t == p.OBS
    assert client.close() == 0


def test_wrong_shape_is_an_error_not_a_bad_frame(client):
    client.init("FedrlTest/Misbehave-v0", module="fedrl_bridge.test_envs")
    client.make([{"mode": "shape", "at_step": 1}])
    client.reset([0], [0])
    t, _, msg = client.step_discrete([0], [0])
    assert t == p.ERROR and b"components" in msg


def test_unknown_env_and_bad_slot_are_reported(client):
    t, msg = client.init("NoSuchEnv-v9")
    assert t == p.ERROR
    t, _ = client.init("CartPole-v1")
    client.make([{}])
    t, _, msg = client.reset([3], [0])
    assert t == p.ERROR and b"slot" in msg


def test_prints_do_not_reach_the_protocol_stream(client):
    # A module that prints on import: its text must go to stderr, not into a frame.
    t, _ = client.init("CartPole-v1", module="this")  # `import this` prints the Zen of Python
    assert t == p.SPACES


def test_exits_when_stdin_closes(client):
    client.init("CartPole-v1")
    assert client.close() == 0


def test_bad_magic_is_refused(client):
    client.proc.stdin.write(b"XXXX" + bytes(20))
    client.proc.stdin.flush()
    t, _, msg = p.read_frame(client.proc.stdout)
    assert t == p.ERROR and b"magic" in msg
    assert client.proc.wait(timeout=10) == 2
