//! fedrl-tests: end-to-end tests that cross crates and processes live in `tests/`.
