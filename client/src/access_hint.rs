//! What a `Permission denied` on the daemon's socket lacks.
//!
//! A worker outside the socket's group is the usual cause of a refused
//! connect (`server.socket_group` unset or another group, `Group=` in the
//! systemd unit, a pod without `supplementalGroups`). The bare `EACCES`
//! does not say which path refused it or what the caller is missing; this
//! finds the first of the socket's directories and the socket itself that
//! this process may not use, and says its owner, group and mode, and this
//! process's uid and groups.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The hint for `socket`, or `None` when every path on the way looks
/// usable (the refusal then came from elsewhere: an LSM, a mount option).
pub fn access_hint(socket: &Path) -> Option<String> {
    let uid = nix::unistd::geteuid().as_raw();
    let mut groups: Vec<u32> = nix::unistd::getgroups()
        .map(|g| g.iter().map(|g| g.as_raw()).collect())
        .unwrap_or_default();
    groups.push(nix::unistd::getegid().as_raw());
    groups.sort_unstable();
    groups.dedup();
    // Directories from the root down (each needs search, x), then the
    // socket itself (connect needs write, w).
    let mut paths: Vec<&Path> = socket.ancestors().skip(1).collect();
    paths.reverse();
    paths.push(socket);
    let last = paths.len() - 1;
    for (i, path) in paths.iter().enumerate() {
        let Ok(md) = std::fs::metadata(path) else {
            continue;
        };
        let need = if i == last { 0o2 } else { 0o1 };
        if permits(md.mode(), md.uid(), md.gid(), uid, &groups, need) {
            continue;
        }
        let what = if i == last {
            "the socket needs write (w) permission"
        } else {
            "a directory on its path needs search (x) permission"
        };
        let group = group_name(md.gid());
        let mine: Vec<String> = groups.iter().map(|g| group_name(*g)).collect();
        return Some(format!(
            "permission denied on {}: {what}; it is owned by uid {} and group {group}, mode {:04o}, \
             and this process is uid {uid} in groups {}: add this user to group {group} \
             (usermod -aG; a pod's securityContext.supplementalGroups), or set the daemon's \
             server.socket_group to a group this user is in",
            path.display(),
            md.uid(),
            md.mode() & 0o7777,
            mine.join(", "),
        ));
    }
    None
}

/// Whether the `need` bits (0o1 search, 0o2 write) of a file with `mode`,
/// owned by `owner`:`group`, are granted to `uid` in `groups` (the kernel's
/// order: owner bits, else group bits, else other bits; root passes).
fn permits(mode: u32, owner: u32, group: u32, uid: u32, groups: &[u32], need: u32) -> bool {
    let bits = if uid == 0 {
        return true;
    } else if owner == uid {
        mode >> 6
    } else if groups.contains(&group) {
        mode >> 3
    } else {
        mode
    };
    bits & need == need
}

/// `name (gid)`, or the bare gid where this host has no name for it.
fn group_name(gid: u32) -> String {
    match nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid)) {
        Ok(Some(g)) => format!("{} ({gid})", g.name),
        _ => gid.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permission_bits_follow_the_kernels_order() {
        // Owner bits only for the owner, even where group or other allow.
        assert!(!permits(0o077, 5, 7, 5, &[7], 0o2));
        assert!(permits(0o660, 5, 7, 6, &[7], 0o2), "a group member writes");
        assert!(!permits(0o660, 5, 7, 6, &[8], 0o2), "a stranger does not");
        assert!(
            permits(0o750, 0, 7, 6, &[7], 0o1),
            "a group member searches"
        );
        assert!(!permits(0o750, 0, 7, 6, &[8], 0o1));
        assert!(permits(0o000, 5, 7, 0, &[], 0o2), "root passes");
    }

    #[test]
    fn root_gets_no_hint() {
        // Run as root (the test suite), nothing is refused: no hint.
        if nix::unistd::geteuid().is_root() {
            let dir = std::env::temp_dir();
            assert_eq!(access_hint(&dir.join("no-such.sock")), None);
        }
    }
}
