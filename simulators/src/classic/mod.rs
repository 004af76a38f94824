//! Gymnasium 1.4.0's classic-control environments with Gymnasium's exact semantics: the same
//! reset distribution (numpy's PCG64 seeded like `env.reset(seed=...)`), dynamics in f64 with
//! Gymnasium's update order, float32 observations, and the `TimeLimit` wrapper's truncation.
//!
//! Physical parameters are public fields holding Gymnasium's defaults so that populations can vary
//! them per user.
//!
//! `state()` returns the Gymnasium state (`env.unwrapped.state`) followed by the number of steps
//! taken in the episode; `set_state()` accepts either that vector or the bare Gymnasium state
//! (which starts the episode clock at zero, as after `reset`).

mod acrobot;
mod cartpole;
mod mountain_car;
mod pendulum;

pub use acrobot::{Acrobot, AcrobotDynamics};
pub use cartpole::{CartPole, CartPoleIntegrator};
pub use mountain_car::MountainCar;
pub use pendulum::Pendulum;

use crate::env::SimError;

/// Writes `values` rounded to f32 into `obs` (Gymnasium returns float32 arrays).
#[inline]
pub(crate) fn write_obs<const N: usize>(
    env: &'static str,
    obs: &mut [f32],
    values: [f64; N],
) -> Result<(), SimError> {
    let got = obs.len();
    let out = obs.get_mut(..N).ok_or(SimError::ObsBuffer {
        env,
        got,
        expected: N,
    })?;
    for (o, v) in out.iter_mut().zip(values) {
        *o = v as f32;
    }
    Ok(())
}

/// Splits a `set_state` argument of `n` (Gymnasium state) or `n + 1` (plus elapsed steps) values.
pub(crate) fn split_state<const N: usize>(
    env: &'static str,
    state: &[f64],
) -> Result<([f64; N], u32), SimError> {
    let (phys, elapsed) = match state.len() {
        l if l == N => (state, 0),
        l if l == N + 1 => {
            let e = state[N];
            if !(e >= 0.0 && e <= f64::from(u32::MAX) && e.fract() == 0.0) {
                return Err(SimError::Invalid(format!(
                    "{env}: elapsed step count {e} is not a non-negative integer"
                )));
            }
            (&state[..N], e as u32)
        }
        got => {
            return Err(SimError::StateLength {
                env,
                got,
                expected: N,
            });
        }
    };
    let mut out = [0.0; N];
    out.copy_from_slice(phys);
    if out.iter().any(|v| !v.is_finite()) {
        return Err(SimError::Invalid(format!(
            "{env}: state has a non-finite component"
        )));
    }
    Ok((out, elapsed))
}

/// Reads a discrete action in `0..n`.
#[inline]
pub(crate) fn discrete_action(
    env: &'static str,
    action: crate::env::Action<'_>,
    n: usize,
) -> Result<usize, SimError> {
    match action {
        crate::env::Action::Discrete(a) if a < n => Ok(a),
        other => Err(SimError::InvalidAction {
            env,
            action: format!("{other:?}"),
            expected: format!("Discrete(0..{n})"),
        }),
    }
}
