//! Stamps the git commit into `iop_engine::build::COMMIT` (`--version`,
//! `iop_build_info`).
//!
//! `IOP_GIT_COMMIT` in the build environment wins (release pipelines,
//! source tarballs); otherwise `git rev-parse --short=12 HEAD` in this
//! checkout; `unknown` outside a git checkout. In release builds (and
//! profiles inheriting from release) the script reruns when HEAD or the
//! branch it points at moves, so the stamp follows commits. Debug builds
//! keep the commit of the last time this crate was compiled: following
//! HEAD there would rebuild the whole workspace, every test binary
//! included, on every commit.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

/// A path from `git rev-parse --git-path`, made absolute against `dir`.
fn git_path(dir: &Path, name: &str) -> Option<PathBuf> {
    let path = PathBuf::from(git(dir, &["rev-parse", "--git-path", name])?);
    Some(if path.is_absolute() {
        path
    } else {
        dir.join(path)
    })
}

/// Tells cargo to rerun on a change of `path`, if it exists (a missing path
/// would rerun the script on every build).
fn watch(path: Option<PathBuf>) {
    if let Some(path) = path.filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// A commit stamp must be short printable ASCII (it ends up in a metric
/// label and a version line).
fn clean(commit: &str) -> Option<String> {
    let commit = commit.trim();
    let ok = !commit.is_empty()
        && commit.len() <= 64
        && commit
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(&b));
    ok.then(|| commit.to_owned())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=IOP_GIT_COMMIT");
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let from_env = std::env::var("IOP_GIT_COMMIT").ok().and_then(|c| clean(&c));
    let commit = match from_env {
        Some(commit) => commit,
        None => {
            if std::env::var("PROFILE").as_deref() == Ok("release") {
                watch(git_path(&dir, "HEAD"));
                if let Some(branch) = git(&dir, &["symbolic-ref", "-q", "HEAD"]) {
                    watch(git_path(&dir, &branch));
                    watch(git_path(&dir, "packed-refs"));
                }
            }
            git(&dir, &["rev-parse", "--short=12", "HEAD"])
                .and_then(|c| clean(&c))
                .unwrap_or_else(|| "unknown".to_owned())
        }
    };
    println!("cargo:rustc-env=IOP_GIT_COMMIT={commit}");
}
