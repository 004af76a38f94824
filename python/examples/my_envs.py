"""A user's own environment for fedrl, registered on import (README, "Your own environment").

`MyOrg/Thermostat-v0`: keep a room at its occupant's setpoint. Each user's room loses heat at its
own rate (`insulation`) and its occupant wants their own `setpoint`: the personalisation that the
scenario draws per user. Observation: room temperature, outside temperature, setpoint (deg C).
Actions: heater off, half, full. Reward: minus the distance to the setpoint, per 10-minute step.
"""

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class Thermostat(gym.Env):
    def __init__(self, insulation: float = 0.9, setpoint: float = 21.0):
        self.insulation = float(insulation)
        self.setpoint = float(setpoint)
        self.observation_space = spaces.Box(-50.0, 60.0, shape=(3,), dtype=np.float32)
        self.action_space = spaces.Discrete(3)

    def _obs(self):
        return np.array([self.temp, self.outside, self.setpoint], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.outside = float(self.np_random.uniform(-5.0, 12.0))
        self.temp = float(self.np_random.uniform(12.0, 24.0))
        return self._obs(), {}

    def step(self, action):
        heat = 1.5 * int(action)  # deg C per step at full power
        loss = (1.0 - self.insulation) * (self.temp - self.outside)
        self.temp += heat - loss
        self.outside += float(self.np_random.normal(0.0, 0.1))
        return self._obs(), -abs(self.temp - self.setpoint), False, False, {}


gym.register(id="MyOrg/Thermostat-v0", entry_point=Thermostat, max_episode_steps=144)
