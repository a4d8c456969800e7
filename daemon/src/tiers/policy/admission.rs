//! Admission to G4: which blocks are worth a write to the shared store.
//!
//! Most blocks of chat/agent traffic are used once (76% on Mooncake), so
//! writing every block through to G4 mostly pays for bytes nobody reads.
//! `AfterFirstReuse` writes a block when it is first hit on G3: a block that
//! proved reusable is much likelier to be reused again (0.42 vs 0.24 on
//! Mooncake), and a block that dies on G3 unread costs no G4 write. The
//! replay measures the trade (bytes written vs a second node's hit ratio).

use kvtier_client::Hints;
use std::str::FromStr;

/// What happened to a block on G3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionEvent {
    /// It was just stored (offloaded) on G3.
    Stored,
    /// It was read from G3 (a hit).
    Hit,
}

/// A G4 admission rule. Pure: the daemon asks it on each G3 event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum G4Admission {
    /// Write every non-ephemeral block through on store.
    All,
    /// Write a non-ephemeral block on its first G3 hit.
    #[default]
    AfterFirstReuse,
}

impl G4Admission {
    /// Whether to write the block to G4 now. Ephemeral blocks never go to
    /// G4; a block already there is never written twice.
    pub fn should_write(self, event: AdmissionEvent, hints: Hints, in_g4: bool) -> bool {
        if hints.ephemeral || in_g4 {
            return false;
        }
        match self {
            G4Admission::All => event == AdmissionEvent::Stored,
            // The engine's own reuse estimate counts as a proof of reuse.
            G4Admission::AfterFirstReuse => {
                event == AdmissionEvent::Hit || hints.expected_reuse > 0 || hints.pinned
            }
        }
    }

    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            G4Admission::All => "all",
            G4Admission::AfterFirstReuse => "after-first-reuse",
        }
    }
}

impl FromStr for G4Admission {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "all" => Ok(Self::All),
            "after-first-reuse" => Ok(Self::AfterFirstReuse),
            _ => Err(format!(
                "unknown G4 admission `{s}` (all | after-first-reuse)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules() {
        let h = Hints::default();
        let eph = Hints {
            ephemeral: true,
            ..h
        };
        let a = G4Admission::All;
        let r = G4Admission::AfterFirstReuse;
        assert!(a.should_write(AdmissionEvent::Stored, h, false));
        assert!(!a.should_write(AdmissionEvent::Stored, eph, false));
        assert!(!a.should_write(AdmissionEvent::Stored, h, true));
        assert!(!r.should_write(AdmissionEvent::Stored, h, false));
        assert!(r.should_write(AdmissionEvent::Hit, h, false));
        assert!(!r.should_write(AdmissionEvent::Hit, eph, false));
        assert_eq!("all".parse::<G4Admission>(), Ok(a));
        assert_eq!(super::super::by_name("default").unwrap().name(), "default");
        assert_eq!(super::super::by_name("lru").unwrap().name(), "lru");
        assert!(super::super::by_name("belady").is_none());
    }
}
