//! DPPG (seed 004): the user-level local PPO update, run on the client agent (filled by the nn work).
