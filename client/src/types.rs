//! Small value types shared by the daemon, the wire protocol and tools.

/// Where a block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    /// Local NVMe on this node.
    G3 = 3,
    /// Another node's G3 (fetched over the peer protocol).
    Peer = 5,
    /// The shared object store.
    G4 = 4,
}

impl Tier {
    /// Wire code.
    pub fn code(self) -> u8 {
        self as u8
    }
    /// From the wire code.
    pub fn from_code(c: u8) -> Option<Self> {
        match c {
            3 => Some(Tier::G3),
            4 => Some(Tier::G4),
            5 => Some(Tier::Peer),
            _ => None,
        }
    }
    /// Lowercase name (`g3`, `peer`, `g4`).
    pub fn name(self) -> &'static str {
        match self {
            Tier::G3 => "g3",
            Tier::Peer => "peer",
            Tier::G4 => "g4",
        }
    }
}

/// Hints an engine attaches to an offloaded block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hints {
    /// Higher keeps the block longer (0 = normal).
    pub priority: u8,
    /// Never evicted while pinned (within the pin budget).
    pub pinned: bool,
    /// Never written below G3 and evicted first (reasoning tokens).
    pub ephemeral: bool,
    /// Expected number of future reuses, if the engine knows (0 = unknown).
    pub expected_reuse: u16,
}
