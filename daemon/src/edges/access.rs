//! Who may use what: the authorization the socket server and the mount
//! share.
//!
//! A caller is a local uid/gid (the socket's `SO_PEERCRED`, a FUSE
//! request's uid/gid). Without `[[tenants]]` in the config the daemon is
//! single-tenant: whoever the socket's permission bits let in may use every
//! namespace and every admin operation (today's behaviour; the socket's
//! owner and group are the boundary). With tenants, a caller may use the
//! namespaces of every tenant whose `uids` or `gids` name it, an admin
//! (`[access] admin_uids` / `admin_gids`, default root and the daemon's own
//! uid) may use all of them plus the admin operations, and anyone else is
//! refused at the handshake.
//!
//! A namespace the caller may not use must look exactly like a namespace
//! the daemon has never seen: read-only operations on it run against a
//! decoy namespace id (a keyed hash of the real one under a per-process
//! random key), so they take the same code path, and the same time, as a
//! miss of an unknown namespace (docs/OPERATIONS.md, "Security").

use crate::base::error::{Error, Result};
use kvtier_client::NamespaceId;
use serde::Deserialize;
use std::collections::BTreeSet;

/// One `[[tenants]]` entry.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// For logs and errors.
    pub name: String,
    /// Local users of this tenant.
    #[serde(default)]
    pub uids: Vec<u32>,
    /// Local groups of this tenant (the caller's primary gid, as
    /// `SO_PEERCRED` reports it).
    #[serde(default)]
    pub gids: Vec<u32>,
    /// Namespace ids (32 hex digits, `kvtier hash` prints
    /// them) this tenant may use.
    pub namespaces: Vec<String>,
}

/// `[access]`: admins and per-uid limits.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AccessSection {
    /// Uids allowed every namespace and the admin operations (list of all
    /// namespaces, stats of everything), and the slots kept for admins.
    /// Unset: root and the daemon's own uid.
    pub admin_uids: Option<Vec<u32>>,
    /// Gids whose members are admins.
    pub admin_gids: Vec<u32>,
    /// Connections one uid may hold at once (unset: a quarter of
    /// `server.max_connections`, at least 1; without tenants, half), so
    /// one user cannot take every slot.
    pub connections_per_uid_max: Option<usize>,
    /// Event subscriptions one uid may hold at once (unset: a quarter of
    /// the bus's subscriber slots, at least 1).
    pub subscribers_per_uid_max: Option<usize>,
    /// Onboard requests one uid may have in flight at once (each may fetch
    /// up to 4096 blocks from peers and G4; unset: 8).
    pub onboards_per_uid_max: Option<usize>,
    /// Leases one uid may hold over all its connections (unset: four
    /// connections' worth, `4 x server.leases_per_conn_max`).
    pub leases_per_uid_max: Option<usize>,
    /// Live pins one uid may have made (unset: a quarter of
    /// `server.pins_max`).
    pub pins_per_uid_max: Option<usize>,
    /// Bytes of blocks one uid may hold leased over all its connections
    /// (unset with tenants: a quarter of `g3.capacity`; without tenants:
    /// unbounded), so a uid that re-leases its blocks cannot keep the
    /// cache from evicting for the others.
    #[serde(deserialize_with = "crate::base::units::de_size_opt")]
    pub lease_bytes_per_uid_max: Option<u64>,
    /// Namespaces holding blocks that one uid (root excepted) may have
    /// offloaded into (unset without tenants: 1024; with tenants each
    /// tenant's list bounds them), so that one local user cannot fill the
    /// disk with namespace directories.
    pub namespaces_per_uid_max: Option<usize>,
    /// Connections only admins may take: the others together hold at most
    /// `server.max_connections` minus these (unset: 8), so that no mix
    /// of users locks root's `kvtier stats` and `kvtier events` out.
    pub admin_connections_reserved: Option<usize>,
    /// Event subscriptions only admins may take (unset: 4): the others
    /// together hold at most the bus's slots minus these.
    pub admin_subscribers_reserved: Option<usize>,
    /// Bytes of blocks one tenant (one uid without tenants) may hold
    /// pinned, by pin requests and by offloads with the pin hint (unset
    /// with tenants: a quarter of `g3.pinned_budget`; without tenants:
    /// unbounded), so that one tenant's pins cannot take the node's pin
    /// budget and the cache from the others.
    #[serde(deserialize_with = "crate::base::units::de_size_opt")]
    pub pin_bytes_per_tenant_max: Option<u64>,
}

/// What one caller may do.
#[derive(Debug, Clone)]
pub struct Grant {
    admin: bool,
    /// An admin by `[access]` (also in single-tenant mode, where everyone
    /// may run admin operations): may take the slots kept for admins.
    reserve: bool,
    namespaces: BTreeSet<NamespaceId>,
    /// The caller's tenant (its index in `[[tenants]]`), whose shares it
    /// draws on.
    tenant: Option<u32>,
}

/// Share accounts of tenants: above every uid a system gives out (a
/// tenant's uids and groups share one account, so two uids do not hold
/// two shares).
pub const TENANT_ACCOUNTS_BASE: u32 = 0xffff_0000;

impl Grant {
    /// Everything (single-tenant mode, admins); `reserve`: may take the
    /// slots kept for admins.
    pub fn all(reserve: bool) -> Grant {
        Grant {
            admin: true,
            reserve,
            namespaces: BTreeSet::new(),
            tenant: None,
        }
    }
    /// Whose per-uid shares (connections, leases, leased bytes, pins,
    /// onboards, subscriptions, namespaces) the caller draws on: its
    /// tenant's, shared by every uid and group of the tenant; an admin's or
    /// a single-tenant daemon's caller, its own uid's.
    pub fn account(&self, uid: u32) -> u32 {
        self.tenant
            .map_or(uid, |t| TENANT_ACCOUNTS_BASE.saturating_add(t))
    }
    /// Whether the caller may use `ns`.
    pub fn may(&self, ns: &NamespaceId) -> bool {
        self.admin || self.namespaces.contains(ns)
    }
    /// Whether the caller may run admin operations.
    pub fn is_admin(&self) -> bool {
        self.admin
    }
    /// Whether the caller may take the connections and subscriptions kept
    /// for admins (`[access] admin_uids` / `admin_gids`, in either mode).
    pub fn may_use_reserve(&self) -> bool {
        self.reserve
    }
    /// The namespaces of a non-admin caller, in id order (`None`: all).
    pub fn namespaces(&self) -> Option<&BTreeSet<NamespaceId>> {
        (!self.admin).then_some(&self.namespaces)
    }
}

struct Tenant {
    uids: Vec<u32>,
    gids: Vec<u32>,
    namespaces: BTreeSet<NamespaceId>,
}

/// The daemon's authorization policy.
pub struct Policy {
    tenants: Option<Vec<Tenant>>,
    admin_uids: Vec<u32>,
    admin_gids: Vec<u32>,
    decoy_key: [u8; 32],
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.tenants {
            None => write!(f, "Policy(single-tenant)"),
            Some(t) => write!(f, "Policy({} tenants)", t.len()),
        }
    }
}

fn random_key() -> [u8; 32] {
    let mut k = [0u8; 32];
    // getrandom(2) never fails for 32 bytes once the pool is initialised;
    // should it, the time and pid still make the decoy unguessable enough
    // for its one job (never to collide with a real namespace).
    // SAFETY: valid buffer of 32 bytes.
    let n = unsafe { libc::getrandom(k.as_mut_ptr() as *mut libc::c_void, 32, 0) };
    if n != 32 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        k = *blake3::hash(format!("{t}:{}", std::process::id()).as_bytes()).as_bytes();
    }
    k
}

impl Policy {
    /// Single-tenant: everyone who reaches the socket may do everything;
    /// nobody is an admin for the kept slots.
    pub fn open() -> Policy {
        Policy {
            tenants: None,
            admin_uids: Vec::new(),
            admin_gids: Vec::new(),
            decoy_key: random_key(),
        }
    }

    /// From the config; no tenants means [`Policy::open`].
    pub fn from_config(tenants: &[TenantConfig], access: &AccessSection) -> Result<Policy> {
        let mut p = Policy::open();
        // Admins also in single-tenant mode: the slots kept for them.
        p.admin_uids = access
            .admin_uids
            .clone()
            .unwrap_or_else(|| vec![0, nix::unistd::geteuid().as_raw()]);
        p.admin_gids = access.admin_gids.clone();
        if tenants.is_empty() {
            return Ok(p);
        }
        let mut out = Vec::with_capacity(tenants.len());
        for (i, t) in tenants.iter().enumerate() {
            let key = format!("tenants[{i}] ({:?})", t.name);
            if t.uids.is_empty() && t.gids.is_empty() {
                return Err(Error::Config {
                    key,
                    problem: "names no uids and no gids; nobody could use it".into(),
                });
            }
            let mut namespaces = BTreeSet::new();
            for n in &t.namespaces {
                let id = NamespaceId::from_hex(n).map_err(|e| Error::Config {
                    key: format!("{key}.namespaces"),
                    problem: format!(
                        "{n:?} is not a namespace id (32 hex digits, as `kvtier hash` prints): {e}"
                    ),
                })?;
                namespaces.insert(id);
            }
            out.push(Tenant {
                uids: t.uids.clone(),
                gids: t.gids.clone(),
                namespaces,
            });
        }
        p.tenants = Some(out);
        Ok(p)
    }

    /// Whether tenants are configured (callers are checked).
    pub fn is_multi_tenant(&self) -> bool {
        self.tenants.is_some()
    }

    /// What `uid`/`gid` may do; `None`: refused.
    pub fn grant(&self, uid: u32, gid: u32) -> Option<Grant> {
        let admin = self.admin_uids.contains(&uid) || self.admin_gids.contains(&gid);
        let Some(tenants) = &self.tenants else {
            return Some(Grant::all(admin));
        };
        if admin {
            return Some(Grant::all(true));
        }
        let mut namespaces = BTreeSet::new();
        let mut tenant = None;
        for (i, t) in tenants.iter().enumerate() {
            if t.uids.contains(&uid) || t.gids.contains(&gid) {
                tenant.get_or_insert(i as u32);
                namespaces.extend(t.namespaces.iter().copied());
            }
        }
        tenant.map(|t| Grant {
            admin: false,
            reserve: false,
            namespaces,
            tenant: Some(t),
        })
    }

    /// Whether `uid`/`gid` may use `ns` (`None`: node-wide views, which
    /// only admins see) without building a [`Grant`] (the mount asks on
    /// every request).
    pub fn may(&self, uid: u32, gid: u32, ns: Option<&NamespaceId>) -> bool {
        let Some(tenants) = &self.tenants else {
            return true;
        };
        if self.admin_uids.contains(&uid) || self.admin_gids.contains(&gid) {
            return true;
        }
        let Some(ns) = ns else {
            return false;
        };
        tenants
            .iter()
            .any(|t| (t.uids.contains(&uid) || t.gids.contains(&gid)) && t.namespaces.contains(ns))
    }

    /// The namespace a request for `ns` runs against: `ns` itself when
    /// allowed, else its decoy, which no block is ever stored under.
    pub fn effective(&self, grant: &Grant, ns: &NamespaceId) -> NamespaceId {
        if grant.may(ns) {
            return *ns;
        }
        let h = blake3::keyed_hash(&self.decoy_key, &ns.0);
        let mut id = [0u8; 16];
        id.copy_from_slice(&h.as_bytes()[..16]);
        NamespaceId(id)
    }
}

/// Namespaces one uid may hold blocks in, without tenants and unset.
pub const NAMESPACES_PER_UID_MAX: usize = 1024;
/// Connections kept for admins, unset.
pub const ADMIN_CONNECTIONS_RESERVED: usize = 8;
/// Event subscriptions kept for admins, unset.
pub const ADMIN_SUBSCRIBERS_RESERVED: usize = 4;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ns(b: u8) -> NamespaceId {
        NamespaceId([b; 16])
    }

    #[test]
    fn single_tenant_allows_everyone_everything() {
        let p = Policy::open();
        let g = p.grant(12345, 12345).unwrap();
        assert!(g.is_admin() && g.may(&ns(1)));
        assert_eq!(p.effective(&g, &ns(1)), ns(1));
        // Only the configured admins may take the slots kept for them.
        let p = Policy::from_config(&[], &AccessSection::default()).unwrap();
        assert!(!p.grant(12345, 12345).unwrap().may_use_reserve());
        assert!(p.grant(0, 0).unwrap().may_use_reserve());
    }

    #[test]
    fn tenants_see_only_their_namespaces_and_strangers_are_refused() {
        let t = vec![
            TenantConfig {
                name: "a".into(),
                uids: vec![1001],
                gids: vec![],
                namespaces: vec![ns(1).to_hex()],
            },
            TenantConfig {
                name: "b".into(),
                uids: vec![],
                gids: vec![2002],
                namespaces: vec![ns(2).to_hex()],
            },
        ];
        let p = Policy::from_config(
            &t,
            &AccessSection {
                admin_uids: Some(vec![7]),
                ..Default::default()
            },
        )
        .unwrap();
        let a = p.grant(1001, 100).unwrap();
        assert!(a.may(&ns(1)) && !a.may(&ns(2)) && !a.is_admin());
        let d = p.effective(&a, &ns(2));
        assert_ne!(d, ns(2));
        assert_ne!(d, ns(1));
        // Stable within the process: the same request costs the same.
        assert_eq!(d, p.effective(&a, &ns(2)));
        let b = p.grant(5, 2002).unwrap();
        assert!(b.may(&ns(2)) && !b.may(&ns(1)));
        assert!(p.grant(4242, 4242).is_none());
        assert!(p.grant(7, 0).unwrap().is_admin());
        assert!(p.grant(7, 0).unwrap().may_use_reserve() && !a.may_use_reserve());
    }

    #[test]
    fn bad_tenants_are_refused_with_the_key() {
        let t = vec![TenantConfig {
            name: "x".into(),
            uids: vec![1],
            gids: vec![],
            namespaces: vec!["nothex".into()],
        }];
        let e = Policy::from_config(&t, &AccessSection::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tenants[0]") && e.contains("namespace id"),
            "{e}"
        );
        let t = vec![TenantConfig {
            name: "x".into(),
            namespaces: vec![],
            ..Default::default()
        }];
        assert!(Policy::from_config(&t, &AccessSection::default()).is_err());
    }
}
