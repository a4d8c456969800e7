//! The lookup side of the in-memory index: an open-addressing multiset of
//! the 64-bit name checks (linear probing, backward-shift deletion), 8
//! bytes per slot, at most 7/8 full.
//!
//! Why beside the id map: a 64-block `lookup_prefix` on 1M blocks was
//! dominated by 64 cold probes of an 80 MB map, each a DRAM and a TLB miss
//! waited for in turn (a probe's data-dependent branches end the CPU's run
//! ahead). Here the 64 home slots of a chain are first loaded in one
//! branch-free pass, so their misses overlap, and the probes then find them
//! in cache. A check is the high half of the name's xxh3-128; matching it
//! alone (without the id half) makes a false "present" about n / 2^63 per
//! probe, and `lookup_prefix` is a hint anyway (reads verify).

/// A per-process secret seed for the in-memory tables' slot choice.
///
/// Checks and ids are unkeyed xxh3 of client-chosen names, so a client
/// that may offload can search for names whose digests share their low
/// bits (about 2^20 hashes per name for 20 bits) and pile them into one
/// probe run, turning every lookup that lands there into a long scan. The
/// slot is therefore chosen from a keyed mix of the digest: without the
/// seed, which never leaves the process, the low bits cannot be aimed at.
/// Nothing persisted depends on it (the index files and snapshots hold
/// the digests themselves).
pub(crate) fn seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| {
        let mut b = [0u8; 8];
        // SAFETY: valid 8-byte buffer.
        let n = unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, 8, 0) };
        if n == 8 {
            u64::from_le_bytes(b)
        } else {
            // No entropy: time and address-space layout still make the
            // seed unknown to another process.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            t ^ (&b as *const _ as u64).rotate_left(32)
        }
    })
}

/// The keyed mix: `v` xor the seed through the splitmix64 finalizer (a
/// bijection in which every output bit depends on every input bit).
pub(crate) fn mix(v: u64) -> u64 {
    let mut z = v ^ seed();
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Multiset of checks.
#[derive(Debug, Default)]
pub struct Presence {
    slots: Vec<u64>,
    len: usize,
}

/// Stored form: never 0 (0 marks an empty slot).
fn stored(check: u64) -> u64 {
    check | 1
}

impl Presence {
    fn home(&self, s: u64) -> usize {
        mix(s) as usize & (self.slots.len() - 1)
    }

    /// Number of checks held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Makes room for `n` checks in all without growing.
    pub fn reserve(&mut self, n: usize) {
        let want = (n.saturating_mul(8) / 7 + 1).next_power_of_two().max(16);
        if want > self.slots.len() {
            self.rehash(want);
        }
    }

    fn rehash(&mut self, cap: usize) {
        let old = std::mem::replace(&mut self.slots, vec![0; cap]);
        self.len = 0;
        for s in old.into_iter().filter(|s| *s != 0) {
            self.place(s);
        }
    }

    fn place(&mut self, s: u64) {
        let m = self.slots.len() - 1;
        let mut i = self.home(s);
        while self.slots[i] != 0 {
            i = (i + 1) & m;
        }
        self.slots[i] = s;
        self.len += 1;
    }

    /// Adds one occurrence of `check`.
    pub fn insert(&mut self, check: u64) {
        if (self.len + 1) * 8 > self.slots.len() * 7 {
            self.rehash((self.slots.len() * 2).max(16));
        }
        self.place(stored(check));
    }

    /// Removes one occurrence of `check`; `false` when absent.
    pub fn remove(&mut self, check: u64) -> bool {
        let Some(mut hole) = self.find(stored(check)) else {
            return false;
        };
        let m = self.slots.len() - 1;
        let mut j = hole;
        loop {
            j = (j + 1) & m;
            let s = self.slots[j];
            if s == 0 {
                break;
            }
            // `s` may fill the hole unless its home lies in (hole, j].
            let h = self.home(s);
            let stays = if hole <= j {
                hole < h && h <= j
            } else {
                hole < h || h <= j
            };
            if !stays {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = 0;
        self.len -= 1;
        true
    }

    fn find(&self, s: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let m = self.slots.len() - 1;
        let mut i = self.home(s);
        loop {
            match self.slots[i] {
                0 => return None,
                x if x == s => return Some(i),
                _ => i = (i + 1) & m,
            }
        }
    }

    /// Whether `check` is held.
    pub fn contains(&self, check: u64) -> bool {
        self.find(stored(check)).is_some()
    }

    /// How many leading checks of `checks` are held. All home slots are
    /// loaded first, without branches on their contents, so that their
    /// cache misses overlap.
    pub fn count_leading(&self, checks: impl Iterator<Item = u64> + Clone) -> usize {
        if self.slots.is_empty() {
            return 0;
        }
        let mut touch = 0u64;
        for c in checks.clone() {
            touch ^= self.slots[self.home(stored(c))];
        }
        std::hint::black_box(touch);
        checks.take_while(|c| self.contains(*c)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn checks_aimed_at_one_slot_spread_over_the_table() {
        // What an attacker can make cheaply: checks equal in their low 24
        // bits (identity slot choice would put all of them in one run).
        let mut p = Presence::default();
        let n = 4096u64;
        for i in 0..n {
            p.insert((i << 24) | 0x5a5a5a);
        }
        let homes: std::collections::HashSet<usize> = (0..n)
            .map(|i| p.home(stored((i << 24) | 0x5a5a5a)))
            .collect();
        assert!(homes.len() as u64 > n / 2, "{} distinct slots", homes.len());
        assert!((0..n).all(|i| p.contains((i << 24) | 0x5a5a5a)));
    }

    #[test]
    fn matches_a_multiset_model_under_random_inserts_and_removes() {
        let mut p = Presence::default();
        let mut model: HashMap<u64, usize> = HashMap::new();
        let mut rng = 7u64;
        let mut next = || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            rng >> 11
        };
        // Few distinct homes (values share low bits) so that runs are long
        // and wrap around, plus duplicates and values differing in bit 0.
        for _ in 0..20_000 {
            let v = (next() % 300) << 1 | (next() & 1);
            let v = v.rotate_left(if next() % 2 == 0 { 0 } else { 60 });
            if next() % 3 == 0 {
                let had = model.get(&(v | 1)).copied().unwrap_or(0) > 0;
                assert_eq!(p.remove(v), had);
                if had {
                    *model.get_mut(&(v | 1)).unwrap() -= 1;
                }
            } else {
                p.insert(v);
                *model.entry(v | 1).or_default() += 1;
            }
            assert_eq!(p.len(), model.values().sum::<usize>());
        }
        for v in 0..(600u64 << 1) {
            for w in [v, v.rotate_left(60)] {
                assert_eq!(
                    p.contains(w),
                    model.get(&(w | 1)).copied().unwrap_or(0) > 0,
                    "{w:x}"
                );
            }
        }
        let held: Vec<u64> = model
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(v, _)| *v)
            .collect();
        assert_eq!(p.count_leading(held.iter().copied()), held.len());
        let absent = u64::MAX - 2;
        let chain = held
            .iter()
            .copied()
            .take(3)
            .chain([absent])
            .chain(held.iter().copied());
        assert_eq!(p.count_leading(chain), held.len().min(3));
    }
}
