//! Layer 5: the application: the configuration file (each section's type
//! lives beside what it configures; only [`config`] composes them), its
//! environment overrides, and start-up steps of `kvtierd`.

pub mod at_rest;
pub mod config;
pub mod config_env;
