//! The value network: a tanh MLP with one linear output (state value in reward units times
//! [`crate::nn::LocalUpdateConfig::reward_scale`]).

use candle_core::{D, Tensor};

use crate::Result;
use crate::mlp::{ParamLayout, forward, value_layers};

/// State values `[users, n]` for observations `[users, n, obs]` under stacked parameters.
pub fn values(layout: &ParamLayout, params: &[Tensor], obs: &Tensor) -> Result<Tensor> {
    Ok(forward(obs, &value_layers(layout, params))?.squeeze(D::Minus1)?)
}
