"""Personalised MuJoCo users: importing this module registers `fedrl/HalfCheetah-v5` and
`fedrl/Hopper-v5`, Gymnasium's HalfCheetah-v5 and Hopper-v5 with two more keyword arguments
that a scenario draws per user (`task.gymnasium.user_kwargs`):

- `mass_scale`: every body's mass and rotational inertia multiplied by this (a heavier or
  lighter robot; inertia scales with mass at fixed geometry);
- `friction_scale`: every geom's sliding friction coefficient multiplied by this (a slipperier
  or grippier floor and feet).

Every other keyword argument (`forward_reward_weight`, `ctrl_cost_weight`,
`reset_noise_scale`, ...) goes to Gymnasium's own class unchanged, and with both scales at 1 the
environment is Gymnasium's (same spaces, rewards, episode limit of 1000 steps). Gymnasium's
MuJoCo constructors take no mass or friction argument: the scales are applied to the compiled
model (`env.unwrapped.model`) right after construction, before any reset, so every episode of
a user runs its own physics. Needs `mujoco` (`scripts/install-python-bridge.sh --extra`).
"""

import gymnasium as gym

# The environments: (registered id, Gymnasium's module and class, episode limit).
_ENVS = {
    "fedrl/HalfCheetah-v5": ("gymnasium.envs.mujoco.half_cheetah_v5", "HalfCheetahEnv", 1000),
    "fedrl/Hopper-v5": ("gymnasium.envs.mujoco.hopper_v5", "HopperEnv", 1000),
}


def scale_model(model, mass_scale: float = 1.0, friction_scale: float = 1.0) -> None:
    """Scales a compiled MuJoCo model in place (masses with their inertias, sliding frictions)."""
    if not (mass_scale > 0.0 and friction_scale > 0.0):
        raise ValueError(
            f"mass_scale and friction_scale must be > 0, got {mass_scale} and {friction_scale}"
        )
    model.body_mass[:] *= mass_scale
    model.body_inertia[:] *= mass_scale
    model.geom_friction[:, 0] *= friction_scale


def _entry(module: str, cls: str):
    def make(mass_scale: float = 1.0, friction_scale: float = 1.0, **kwargs):
        import importlib

        env = getattr(importlib.import_module(module), cls)(**kwargs)
        scale_model(env.model, float(mass_scale), float(friction_scale))
        return env

    return make


for _id, (_module, _cls, _steps) in _ENVS.items():
    if _id not in gym.registry:
        gym.register(id=_id, entry_point=_entry(_module, _cls), max_episode_steps=_steps)
