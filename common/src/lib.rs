//! fedrl-common: what both sides of a fedrl deployment share.
//!
//! - [`privacy`]: mechanisms, clipping, noise, accountants (RDP, PLD) and the durable ledger.
//!   Pure Rust, no candle or tokio, so it is fast to build and to test.
//! - [`protocol`]: the versioned wire messages and their one codec.
//! - [`scenario`]: the TOML scenario schema with documented defaults; [`task`]: the tasks it
//!   trains and [`device`]: where tensors live, both plain data (models and losses are in
//!   `fedrl-rl`); [`offline`]: dataset specs, CQL settings and the DP-SGD update modes.

pub mod device;
pub mod offline;
pub mod privacy;
pub mod protocol;
pub mod scenario;
pub mod selective;
pub mod task;
