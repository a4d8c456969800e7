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
