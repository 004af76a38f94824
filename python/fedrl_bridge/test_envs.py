"""Environments for the bridge's tests: importing this module registers them.

- `FedrlTest/Counter-v0` stands for a user's own environment: a 3-float observation
  (position, the user's `scale`, steps taken), 2 discrete actions (-1/+1 to the position),
  reward = action index x scale, terminated after `length` steps.
- `FedrlTest/Misbehave-v0` is the same environment that misbehaves on purpose at step
  `at_step` according to `mode`: `crash` (the process exits), `hang` (sleeps forever), `nan`
  (a NaN observation), `shape` (an observation of the wrong length), `raise` (an exception),
  `none` (behaves).
- `FedrlTest/Continuous-v0`: a 2-float Box action in [-1, 1]; the observation echoes the action
  clipped, reward = -|action|^2; with `crash_at = n > 0` the process exits at step n of an
  episode.
"""

import os
import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class Counter(gym.Env):
    def __init__(self, scale: float = 1.0, length: int = 10):
        self.scale = float(scale)
        self.length = int(length)
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(3,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.pos = 0.0
        self.t = 0

    def _obs(self):
        return np.array([self.pos, self.scale, self.t], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = float(self.np_random.integers(0, 100))
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.pos += 1.0 if int(action) == 1 else -1.0
        self.t += 1
        return self._obs(), float(action) * self.scale, self.t >= self.length, False, {}


class Misbehave(Counter):
    def __init__(self, mode: str = "none", at_step: int = 3, **kw):
        super().__init__(**kw)
        self.mode = mode
        self.at_step = int(at_step)

    def step(self, action):
        obs, r, te, tr, info = super().step(action)
        if self.t == self.at_step:
            if self.mode == "crash":
                os._exit(3)
            if self.mode == "hang":
                while True:
                    time.sleep(60)
            if self.mode == "nan":
                obs[0] = np.nan
            if self.mode == "shape":
                obs = np.zeros(5, dtype=np.float32)
            if self.mode == "raise":
                raise RuntimeError("misbehaving on purpose")
        return obs, r, te, tr, info


class Continuous(gym.Env):
    def __init__(self, crash_at: int = 0):
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.crash_at = int(crash_at)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        if self.crash_at > 0 and self.t >= self.crash_at:
            os._exit(3)
        a = np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)
        return a, -float(np.sum(a * a)), False, False, {}


for _id, _entry in [
    ("FedrlTest/Counter-v0", Counter),
    ("FedrlTest/Misbehave-v0", Misbehave),
    ("FedrlTest/Continuous-v0", Continuous),
]:
    if _id not in gym.registry:
        gym.register(id=_id, entry_point=_entry, max_episode_steps=50)
