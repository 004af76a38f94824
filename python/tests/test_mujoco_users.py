"""`fedrl_bridge.mujoco_users`: unit scales are Gymnasium's environment, other scales change
the physics (skipped without MuJoCo: `scripts/install-python-bridge.sh --extra` installs it)."""

import numpy as np
import pytest

pytest.importorskip("mujoco")

import gymnasium as gym  # noqa: E402

import fedrl_bridge.mujoco_users  # noqa: E402,F401  (registers the environments)


@pytest.mark.parametrize("base", ["HalfCheetah-v5", "Hopper-v5"])
def test_unit_scales_are_gymnasiums_environment_and_others_are_not(base):
    ref = gym.make(base)
    same = gym.make(f"fedrl/{base}", mass_scale=1.0, friction_scale=1.0)
    heavy = gym.make(f"fedrl/{base}", mass_scale=1.3, friction_scale=0.6)
    assert same.spec.max_episode_steps == ref.spec.max_episode_steps == 1000
    assert same.observation_space == ref.observation_space
    assert same.action_space == ref.action_space
    np.testing.assert_allclose(
        heavy.unwrapped.model.body_mass, 1.3 * ref.unwrapped.model.body_mass
    )
    np.testing.assert_allclose(
        heavy.unwrapped.model.geom_friction[:, 0], 0.6 * ref.unwrapped.model.geom_friction[:, 0]
    )
    rng = np.random.default_rng(0)
    o_ref, _ = ref.reset(seed=5)
    o_same, _ = same.reset(seed=5)
    o_heavy, _ = heavy.reset(seed=5)
    assert np.array_equal(o_ref, o_same) and np.array_equal(o_ref, o_heavy)
    differs = False
    for _ in range(30):
        a = rng.uniform(-1, 1, ref.action_space.shape).astype(np.float32)
        r, s, h = ref.step(a), same.step(a), heavy.step(a)
        assert np.array_equal(r[0], s[0]) and r[1] == s[1]
        differs |= not np.allclose(r[0], h[0])
    assert differs


def test_non_positive_scales_are_refused():
    with pytest.raises(ValueError):
        gym.make("fedrl/HalfCheetah-v5", mass_scale=0.0)
