//! How the CLI reports errors and describes itself (issue 30): the cause
//! chain always, a backtrace only when asked with --backtrace (never just
//! because RUST_BACKTRACE is set, as it is on many developer machines), and
//! a --help that names every command.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

#[test]
fn errors_print_their_cause_chain_and_no_backtrace_unless_asked() {
    let sock = "/nonexistent-kvtier-dir/kvtierd.sock";
    let o = kvtier()
        .args(["stats", "--socket", sock])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.starts_with("kvtier: "), "{err}");
    // The chain: what failed, and why.
    assert!(err.contains(sock) && err.contains("No such file"), "{err}");
    assert!(
        !err.contains("Stack backtrace") && !err.contains("lang_start"),
        "a backtrace without --backtrace:\n{err}"
    );
    let o = kvtier()
        .args(["--backtrace", "stats", "--socket", sock])
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("No such file"), "{err}");
    assert!(
        err.contains("main"),
        "--backtrace printed no frames:\n{err}"
    );
}

#[test]
fn help_names_every_command() {
    let o = kvtier().arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&o.stdout);
    let about = help.lines().next().unwrap();
    let commands: Vec<&str> = help
        .split("Commands:")
        .nth(1)
        .unwrap()
        .split("Options:")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert!(commands.contains(&"evict"), "{help}");
    for c in commands {
        assert!(
            about.contains(c),
            "the first line of --help omits {c}: {about}"
        );
    }
}

/// A uid the socket refuses is told what it lacks: which path refused it
/// (the socket, or a directory on its way), that path's owner, group and
/// mode, and its own uid and groups (issue 30: a bare `Permission denied`,
/// under "is kvtierd running?"). Needs root to make the refusing files and
/// to run kvtier as uid 65534 (setpriv), as the test suite runs.
#[test]
fn a_refused_uid_is_told_what_it_lacks() {
    use std::os::unix::fs::PermissionsExt as _;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root");
        return;
    }
    let gid = 4242u32;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let run_dir = dir.path().join("run");
    std::fs::create_dir(&run_dir).unwrap();
    let sock = run_dir.join("kvtierd.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    std::os::unix::fs::chown(&sock, Some(0), Some(gid)).unwrap();
    std::os::unix::fs::chown(&run_dir, Some(0), Some(gid)).unwrap();
    let as_nobody = || {
        let o = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(env!("CARGO_BIN_EXE_kvtier"))
            .args(["stats", "--socket"])
            .arg(&sock)
            .output()
            .expect("setpriv");
        assert_eq!(o.status.code(), Some(1), "{o:?}");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    // The socket refuses: 0660, group 4242.
    std::fs::set_permissions(&run_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o660)).unwrap();
    let err = as_nobody();
    for want in [
        &format!("permission denied on {}", sock.display()),
        "the socket needs write (w) permission",
        &format!("group {gid}, mode 0660"),
        "and this process is uid 65534 in groups ",
        &format!("add this user to group {gid}"),
        "server.socket_group",
    ] {
        assert!(err.contains(want), "{want:?} not in: {err}");
    }
    assert!(!err.contains("is kvtierd running"), "{err}");
    // Its directory refuses: 0750, group 4242.
    std::fs::set_permissions(&run_dir, std::fs::Permissions::from_mode(0o750)).unwrap();
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let err = as_nobody();
    for want in [
        &format!("permission denied on {}:", run_dir.display()),
        "a directory on its path needs search (x) permission",
        &format!("group {gid}, mode 0750"),
    ] {
        assert!(err.contains(want), "{want:?} not in: {err}");
    }
}
