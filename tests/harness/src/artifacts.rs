//! Finding, and building when needed, the `.wasm` files the tests load.
//!
//! - The kvroute module: `$KVROUTE_WASM` if set (used as is), otherwise
//!   built with `cargo build --release --target wasm32-wasip1 -p kvroute-wasm`
//!   into the current target dir, so a test never runs a stale module.
//! - The smaller kvroute module without the `tokenizer` feature: built with
//!   `--no-default-features` into `<target>/no-tokenizer`, a target dir of
//!   its own, so that it never replaces the default module's file.
//! - The abi-probe fixture (`tests/harness/fixtures/abi-probe`): built the
//!   same way from its own manifest.
//!
//! Each build runs once per test process. A failed build is reported with
//! cargo's own message and the command to run by hand.

use anyhow::{anyhow, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// The cargo target dir in use: `$CARGO_TARGET_DIR` or `<repo>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                repo_root().join(dir)
            }
        }
        None => repo_root().join("target"),
    }
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string())
}

fn run_build(args: &[&str], what: &str, by_hand: &str) -> std::result::Result<(), String> {
    let out = Command::new(cargo())
        .args(args)
        .current_dir(repo_root())
        .output()
        .map_err(|e| format!("cannot run cargo to build {what}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(25).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    let hint = if stderr.contains("wasm32-wasip1") && stderr.contains("target") {
        "\n(if the target is missing: rustup target add wasm32-wasip1)"
    } else {
        ""
    };
    Err(format!(
        "building {what} failed; build it by hand with:\n  {by_hand}{hint}\ncargo said:\n{}",
        tail.join("\n")
    ))
}

/// The abi-probe fixture module, built once per process.
pub fn probe_wasm() -> Result<PathBuf> {
    static BUILT: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let manifest = repo_root().join("tests/harness/fixtures/abi-probe/Cargo.toml");
            let target = target_dir().join("fixtures");
            let manifest_s = manifest.to_string_lossy().into_owned();
            let target_s = target.to_string_lossy().into_owned();
            run_build(
                &[
                    "build",
                    "--release",
                    "--quiet",
                    "--target",
                    "wasm32-wasip1",
                    "--manifest-path",
                    &manifest_s,
                    "--target-dir",
                    &target_s,
                ],
                "the abi-probe fixture",
                &format!(
                    "cargo build --release --target wasm32-wasip1 --manifest-path {manifest_s}"
                ),
            )?;
            Ok(target.join("wasm32-wasip1/release/abi_probe.wasm"))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// A release build of kvroute-wasm into `target` with `extra` cargo flags
/// (e.g. `--no-default-features`), and the module's path.
fn build_kvroute_module(
    target: &Path,
    extra: &[&str],
    what: &str,
) -> std::result::Result<PathBuf, String> {
    let target_s = target.to_string_lossy().into_owned();
    let mut args = vec![
        "build",
        "--release",
        "--quiet",
        "--target",
        "wasm32-wasip1",
        "-p",
        "kvroute-wasm",
    ];
    args.extend_from_slice(extra);
    let by_hand = args
        .iter()
        .filter(|a| **a != "--quiet")
        .copied()
        .collect::<Vec<_>>()
        .join(" ");
    args.extend_from_slice(&["--target-dir", &target_s]);
    run_build(&args, what, &format!("cargo {by_hand}"))?;
    let path = target.join("wasm32-wasip1/release/kvroute_wasm.wasm");
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "cargo built kvroute-wasm but {} is missing",
            path.display()
        ))
    }
}

/// The kvroute module: `$KVROUTE_WASM`, or a fresh release build.
pub fn kvroute_wasm() -> Result<PathBuf> {
    static BUILT: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            if let Some(path) = std::env::var_os("KVROUTE_WASM") {
                let path = PathBuf::from(path);
                return if path.is_file() {
                    Ok(path)
                } else {
                    Err(format!(
                        "KVROUTE_WASM={} is not a file; unset it to let the tests build the module, or build it with:\n  cargo build --release --target wasm32-wasip1 -p kvroute-wasm",
                        path.display()
                    ))
                };
            }
            build_kvroute_module(&target_dir(), &[], "the kvroute module")
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// The kvroute module built without the `tokenizer` feature (`--no-default-features`:
/// precise mode hashes token-ID prompts only), in `<target>/no-tokenizer`.
pub fn kvroute_wasm_without_tokenizer() -> Result<PathBuf> {
    static BUILT: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            build_kvroute_module(
                &target_dir().join("no-tokenizer"),
                &["--no-default-features"],
                "the kvroute module without the tokenizer feature",
            )
        })
        .clone()
        .map_err(|e| anyhow!(e))
}
