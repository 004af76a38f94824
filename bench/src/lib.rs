//! fedrl-bench: micro benchmarks, load/churn generators and peer comparisons (see README.md).

/// Runs candle on one thread and keeps its buffers out of mmap, as the `fedrl` binary does:
/// small MLPs are several times slower on more threads, and far slower beside other jobs
/// (RUST-NOTES). Call first thing in `main`, while the process is single-threaded.
pub fn train_like_fedrl() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: called before any other thread exists (documented contract above).
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    fedrl_rl::alloc::tune_for_training();
}
