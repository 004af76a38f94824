//! fedrl-bench: micro benchmarks, load/churn generators and peer comparisons (see README.md).
