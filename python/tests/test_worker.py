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


def test_reusing_worker_keeps_equal_kwargs_envs_and_plays_the_same_episodes():
    """MAKE with `reuse_envs`: slots with the kwargs of a previous slot get that environment
    back (no new `gymnasium.make`), other kwargs get new ones, and a reused environment reset
    with a seed plays the episode a new one plays."""
    from fedrl_bridge.worker import Worker

    def episode(w, slot, seed, steps=20):
        obs = [w.reset(1, np.asarray([slot], "<i8").tobytes() + np.asarray([seed], "<u8").tobytes())]
        for k in range(steps):
            a = np.asarray([slot], "<i8").tobytes() + np.asarray([k % 2], "<i8").tobytes()
            obs.append(w.step(1, a))
        return obs

    fresh = Worker()
    fresh.init({"env_id": "CartPole-v1", "probe_kwargs": {}})
    reuse = Worker()
    reuse.init({"env_id": "CartPole-v1", "probe_kwargs": {}, "reuse_envs": True})
    assert reuse.make([{}, {}]) == 2
    first = [id(e) for e in reuse.envs]
    # Played part-way (an unfinished episode), as a round leaves them.
    episode(reuse, 0, 5, steps=7)
    episode(reuse, 1, 6, steps=3)
    assert reuse.make([{"sutton_barto_reward": True}, {}, {}]) == 3
    assert reuse.made == 3 and reuse.reused == 2
    assert id(reuse.envs[0]) not in first
    assert {id(e) for e in reuse.envs[1:]} == set(first)
    fresh.make([{"sutton_barto_reward": True}, {}, {}])
    for slot in range(3):
        assert episode(reuse, slot, 1234 + slot) == episode(fresh, slot, 1234 + slot)
    # Without reuse_envs every MAKE makes every environment.
    fresh.make([{}, {}, {}])
    assert fresh.made == 6 and fresh.reused == 0


def test_reusing_worker_bounds_its_idle_environments():
    from fedrl_bridge import worker as wmod

    w = wmod.Worker()
    w.init({"env_id": "CartPole-v1", "probe_kwargs": {}, "reuse_envs": True})
    n = wmod.IDLE_MIN + 10
    w.make([{"sutton_barto_reward": bool(i % 2), "render_mode": None} for i in range(2)])
    # Distinct kwargs every round (as continuous per-user draws are): nothing to reuse, and
    # the parked environments stay bounded.
    for r in range(3):
        w.make([{"max_episode_steps": 100 + r * n + i} for i in range(n)])
        assert sum(len(v) for v in w.idle.values()) <= max(n, wmod.IDLE_MIN)
    assert w.reused == 0
    w.close_envs()
    assert w.envs == [] and w.idle == {}
