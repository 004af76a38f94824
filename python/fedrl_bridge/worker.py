"""A Gymnasium bridge worker: a batch of environments stepped on command over stdin/stdout.

The client agent (Rust, `simulators/src/gym_bridge/`) starts one or more of these with
`python -m fedrl_bridge.worker`, owns them, and talks the binary protocol of `protocol.py`.
Invariants:
- stdout carries protocol frames only: file descriptor 1 is moved to a private descriptor at
  start and 1 then points at stderr, so a `print` in a user's environment cannot corrupt a frame.
- The worker exits when its stdin closes (the agent went away) and, on Linux, when its parent
  dies (`PR_SET_PDEATHSIG`, set again here in case the agent could not), so no worker outlives
  its agent.
- One environment per slot, made with `gymnasium.make(env_id, **kwargs)` after importing the
  scenario's module (so a user's own registered environment works); resets take a seed per
  environment; nothing autoresets.
- With `reuse_envs` (INIT; the agent's default), a MAKE keeps the environment objects of the
  previous MAKE and hands each to a later slot with the same keyword arguments instead of making
  a new one (at most `max(slots, IDLE_MIN)` idle ones are kept, the oldest closed first). Every
  slot is reset with its round's seed before it steps, and Gymnasium's reset contract (a seeded
  reset re-seeds the environment and restores its initial state) makes a reused environment
  play the episodes a new one would. An environment that keeps state across resets breaks that
  contract: its scenario sets `task.gymnasium.reuse_envs = false`.
- Observations go out as flat float32 (a Discrete observation as a one-hot vector); Discrete
  actions come in as indices 0..n (the space's `start` is added here), Box actions as float32
  cast to the space's dtype and shape.
"""

import ctypes
import importlib
import json
import os
import signal
import sys

import numpy as np

from . import protocol as p


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (best effort elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


def space_json(space) -> dict:
    """The space as the Rust side reads it; raises for spaces the bridge does not carry."""
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        return {"kind": "discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.Box):
        low = np.asarray(space.low, dtype=np.float64).ravel()
        high = np.asarray(space.high, dtype=np.float64).ravel()
        # JSON has no infinities: send them as null.
        def enc(v):
            return [None if not np.isfinite(x) else float(x) for x in v]

        return {
            "kind": "box",
            "shape": [int(s) for s in space.shape],
            "dtype": str(space.dtype),
            "low": enc(low),
            "high": enc(high),
        }
    raise ValueError(
        f"unsupported space {space!r}: the bridge carries Discrete and Box spaces"
    )


class Encoder:
    """Flattens one environment's observations into float32 rows."""

    def __init__(self, space):
        from gymnasium import spaces

        if isinstance(space, spaces.Discrete):
            self.onehot = (int(space.n), int(space.start))
            self.dim = int(space.n)
        elif isinstance(space, spaces.Box):
            self.onehot = None
            self.dim = int(np.prod(space.shape, dtype=np.int64))
        else:
            raise ValueError(f"unsupported observation space {space!r}")

    def write(self, obs, out: np.ndarray) -> None:
        if self.onehot is not None:
            n, start = self.onehot
            out[:] = 0.0
            k = int(obs) - start
            if not 0 <= k < n:
                raise ValueError(f"observation {obs!r} outside Discrete({n}, start={start})")
            out[k] = 1.0
            return
        flat = np.asarray(obs, dtype=np.float32).ravel()
        if flat.size != self.dim:
            raise ValueError(
                f"observation has {flat.size} components, the space says {self.dim}"
            )
        out[:] = flat


# Idle environments a reusing worker keeps at least (more when a round has more slots).
IDLE_MIN = 64


def kwargs_key(kw: dict) -> str:
    """Equal keyword arguments, equal key (the JSON the agent sent, canonically ordered)."""
    return json.dumps(kw, sort_keys=True)


class Worker:
    def __init__(self):
        self.env_id = None
        self.envs = []
        # The kwargs key of each slot's environment (reusing workers only).
        self.env_keys = []
        # Reusing workers: environments of earlier MAKEs not in a slot now, by kwargs key, in
        # the order they were parked (oldest first: those are closed first).
        self.idle = {}
        self.reuse = False
        # How many environments MAKE made and reused since INIT (for tests and diagnostics).
        self.made = 0
        self.reused = 0
        self.encoder = None
        self.action_space = None

    # --- requests -------------------------------------------------------------------------

    def init(self, req: dict) -> bytes:
        import gymnasium as gym

        module = req.get("module")
        if module:
            importlib.import_module(module)
        self.env_id = req["env_id"]
        self.reuse = bool(req.get("reuse_envs", False))
        env = gym.make(self.env_id, **(req.get("probe_kwargs") or {}))
        try:
            obs_space = space_json(env.observation_space)
            act_space = space_json(env.action_space)
            self.encoder = Encoder(env.observation_space)
            self.action_space = env.action_space
        finally:
            env.close()
        return json.dumps(
            {
                "observation": obs_space,
                "action": act_space,
                "gymnasium": gym.__version__,
                "protocol": p.VERSION,
            }
        ).encode()

    def make(self, kwargs_list: list) -> int:
        import gymnasium as gym

        if self.env_id is None:
            raise RuntimeError("MAKE before INIT")
        if not self.reuse:
            self.close_envs()
            for kw in kwargs_list:
                self.envs.append(gym.make(self.env_id, **kw))
                self.made += 1
            return len(self.envs)
        # Park the slots' environments, then take each new slot's from the parked ones with
        # the same kwargs, making only what is missing.
        for key, env in zip(self.env_keys, self.envs):
            self.idle.setdefault(key, []).append(env)
        self.envs, self.env_keys = [], []
        for kw in kwargs_list:
            key = kwargs_key(kw)
            parked = self.idle.get(key)
            if parked:
                env = parked.pop()
                if not parked:
                    del self.idle[key]
                self.reused += 1
            else:
                env = gym.make(self.env_id, **kw)
                self.made += 1
            self.envs.append(env)
            self.env_keys.append(key)
        self._trim_idle(max(len(kwargs_list), IDLE_MIN))
        return len(self.envs)

    def _trim_idle(self, keep: int) -> None:
        """Closes parked environments, oldest kwargs first, until at most `keep` remain."""
        total = sum(len(v) for v in self.idle.values())
        while total > keep and self.idle:
            key = next(iter(self.idle))
            env = self.idle[key].pop(0)
            if not self.idle[key]:
                del self.idle[key]
            _close(env)
            total -= 1

    def _slots(self, payload: bytes, n: int):
        slots = np.frombuffer(payload, dtype="<i8", count=n)
        for s in slots:
            if not 0 <= s < len(self.envs):
                raise IndexError(f"slot {s} out of range (0..{len(self.envs)})")
        return slots

    def reset(self, n: int, payload: bytes) -> bytes:
        if len(payload) != 16 * n:
            raise ValueError(f"RESET payload of {len(payload)} bytes for {n} envs")
        slots = self._slots(payload, n)
        seeds = np.frombuffer(payload, dtype="<u8", count=n, offset=8 * n)
        out = np.zeros((n, self.encoder.dim), dtype="<f4")
        for i, (s, seed) in enumerate(zip(slots, seeds)):
            obs, _info = self.envs[s].reset(seed=int(seed))
            self.encoder.write(obs, out[i])
        return out.tobytes()

    def step(self, n: int, payload: bytes) -> bytes:
        from gymnasium import spaces

        slots = self._slots(payload, n)
        rest = payload[8 * n :]
        space = self.action_space
        if isinstance(space, spaces.Discrete):
            if len(rest) != 8 * n:
                raise ValueError(f"STEP: {len(rest)} action bytes for {n} discrete actions")
            acts = np.frombuffer(rest, dtype="<i8", count=n)
            actions = [int(space.start + a) for a in acts]
        else:
            dim = int(np.prod(space.shape, dtype=np.int64))
            if len(rest) != 4 * n * dim:
                raise ValueError(f"STEP: {len(rest)} action bytes for {n} x {dim} floats")
            acts = np.frombuffer(rest, dtype="<f4").reshape((n, *space.shape))
            actions = [a.astype(space.dtype) for a in acts]
        obs_out = np.zeros((n, self.encoder.dim), dtype="<f4")
        rew = np.zeros(n, dtype="<f8")
        term = np.zeros(n, dtype="u1")
        trunc = np.zeros(n, dtype="u1")
        for i, (s, a) in enumerate(zip(slots, actions)):
            obs, r, te, tr, _info = self.envs[s].step(a)
            self.encoder.write(obs, obs_out[i])
            rew[i] = float(r)
            term[i] = bool(te)
            trunc[i] = bool(tr)
        return obs_out.tobytes() + rew.tobytes() + term.tobytes() + trunc.tobytes()

    def close_envs(self) -> None:
        for e in self.envs:
            _close(e)
        for parked in self.idle.values():
            for e in parked:
                _close(e)
        self.envs, self.env_keys, self.idle = [], [], {}


def _close(env) -> None:
    try:
        env.close()
    except Exception:  # a user's close() must not take the worker down
        pass


def serve(inp, out) -> int:
    """Answers requests from `inp` on `out` until CLOSE or end of input; returns the exit code."""
    w = Worker()

    def send(t, count, payload=b""):
        out.write(p.pack(t, count, payload))
        out.flush()

    while True:
        try:
            frame = p.read_frame(inp)
        except p.ProtocolError as e:
            send(p.ERROR, 0, f"protocol: {e}".encode())
            return 2
        if frame is None:  # the agent closed our stdin: it is gone or done with us
            w.close_envs()
            return 0
        t, n, payload = frame
        try:
            if t == p.INIT:
                send(p.SPACES, 0, w.init(json.loads(payload)))
            elif t == p.MAKE:
                kws = json.loads(payload)
                if not isinstance(kws, list) or len(kws) != n:
                    raise ValueError(f"MAKE: expected a list of {n} kwargs dicts")
                send(p.OK, w.make(kws))
            elif t == p.RESET:
                send(p.OBS, n, w.reset(n, payload))
            elif t == p.STEP:
                send(p.STEP_RESULT, n, w.step(n, payload))
            elif t == p.CLOSE:
                w.close_envs()
                return 0
            else:
                send(p.ERROR, 0, f"unknown message type {t}".encode())
        except Exception as e:  # reported to the agent, which decides (restart, drop users)
            send(p.ERROR, 0, f"{type(e).__name__}: {e}".encode())


def main() -> int:
    _die_with_parent()
    # Ctrl-C in a terminal reaches the whole process group: the agent decides when its workers
    # end (closing their stdin, or by its death), not the keyboard.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Protocol frames get a private copy of stdout; fd 1 (and sys.stdout) become stderr so
    # that nothing a user's environment prints can land inside a frame.
    proto_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    out = os.fdopen(proto_fd, "wb", buffering=1 << 16)
    inp = os.fdopen(os.dup(0), "rb", buffering=1 << 16)
    return serve(inp, out)


if __name__ == "__main__":
    sys.exit(main())
