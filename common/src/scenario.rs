//! Scenario configuration (TOML). Every field has a documented default.
