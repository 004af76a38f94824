//! Diffusion synthesizers of offline-RL data (seed 003, PrivORL): what turns public and
//! sensitive transitions into a synthetic dataset.
//!
//! This module is the model side, free of any privacy accounting: a DP fine-tuning (the
//! aggregator's summed path, DESIGN §2.4) drives the same networks and losses.
//! - [`encode`]: transitions `(s, a, r, s', done)` as real vectors (discrete actions one-hot,
//!   argmax on the way back) and back;
//! - [`normalize`]: per-dimension standardisation fitted on public data only ([`PublicRows`]),
//!   and the few-valued entries synthetic values are snapped to ([`PublicSupport`]);
//! - [`denoiser`]: SynthER's residual-MLP denoiser (random-Fourier-feature time embedding);
//! - [`edm`]: EDM's preconditioning, training loss and stochastic Heun sampler;
//! - [`ema`]: the exponential moving average of the weights samples are drawn from;
//! - [`synth`]: the diffusion model (optimiser, EMA, sampling) and PrivORL-n's transition
//!   synthesizer (the model with the encoding and the public normaliser);
//! - [`curiosity`]: RND curiosity scores and curiosity-driven pre-training on public data;
//! - [`trajectory`]: PrivORL-j, fragments with link conditions, the conditional MLP and
//!   transformer denoisers, stitched generation and the per-trajectory DP contribution.
//! - [`dp`]: per-unit clipped gradients of the EDM loss (exact per-example norms) for DP
//!   fine-tuning.
//!
//! Sources. Constants cite the authors' code by file and line: SynthER (`conglu1997/SynthER`)
//! and PrivORL (`2019ChenGong/PrivORL`, which copies SynthER's `synther/` tree and edits it).
//! "gin line N" means SynthER's `config/resmlp_denoiser.gin`; PrivORL's copy of that file holds
//! the same values one line later from line 6 on, except the batch size (128 there, line 34).
//!
//! Units: every model-side value is in normalised units (public mean 0, standard deviation 1
//! per real entry); [`synth::TransitionSynthesizer::sample`] returns environment units.

pub mod curiosity;
pub mod denoiser;
pub mod dp;
pub mod edm;
pub mod ema;
pub mod encode;
pub mod normalize;
pub mod synth;
pub mod trajectory;

pub use curiosity::{CuriosityConfig, PretrainConfig, Rnd, pretrain, replace_with_most_novel};
pub use denoiser::{Denoiser, DenoiserConfig, DenoiserSpec};
pub use edm::EdmConfig;
pub use ema::{Ema, EmaConfig};
pub use encode::{ActionCoding, Actions, TransitionLayout, Transitions};
pub use normalize::{Normalizer, PublicRows, PublicSupport};
pub use synth::{
    DiffusionModel, SYNTH_META_KEY, SynthesizerConfig, TrainConfig, TransitionSynthesizer, Weights,
};
