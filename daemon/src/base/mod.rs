//! Layer 1: the vocabulary and contracts every other layer shares. Imports
//! nothing from the daemon's other layers.
//!
//! Architecture invariant: nothing here knows a tier, a socket or a config
//! file; a size is parsed by [`units`], a tier is a [`tier::BlockTier`], what
//! the server serves from is a [`backend::Backend`].

pub mod backend;
pub mod error;
pub mod events;
pub mod http_gate;
pub mod id_floor;
pub mod log_limit;
pub mod tier;
pub mod units;
pub mod workers;
