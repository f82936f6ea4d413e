//! What this build is: version, commit and whether io_uring is usable here
//! (`--version` of both binaries; `iop_build_info{version,commit}`).
//!
//! [`COMMIT`] is stamped by `engine/build.rs`: `IOP_GIT_COMMIT` from the
//! build environment if set, else `git rev-parse --short=12 HEAD`, else
//! `unknown`.

use crate::rt::FORCE_LEGACY_ENV;

/// The workspace version (`Cargo.toml` `[workspace.package] version`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The git commit this build came from (12 hex digits), or `unknown`.
pub const COMMIT: &str = env!("IOP_GIT_COMMIT");

/// Whether this process can use io_uring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoUring {
    /// The kernel offers every io_uring operation monoio needs.
    Available,
    /// The kernel (or a seccomp/container policy) refuses io_uring, or lacks
    /// an operation: the legacy epoll driver runs.
    Unavailable,
    /// `MONOIO_FORCE_LEGACY_DRIVER` turns it off (not probed).
    Disabled,
}

impl IoUring {
    /// Probes this machine (monoio's own detection, so the answer is the
    /// driver the runtime will pick).
    pub fn probe() -> Self {
        if force_legacy_set(std::env::var(FORCE_LEGACY_ENV).ok().as_deref()) {
            IoUring::Disabled
        } else if monoio::utils::detect_uring() {
            IoUring::Available
        } else {
            IoUring::Unavailable
        }
    }
}

impl std::fmt::Display for IoUring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoUring::Available => "available",
            IoUring::Unavailable => "unavailable",
            IoUring::Disabled => "disabled by MONOIO_FORCE_LEGACY_DRIVER",
        })
    }
}

/// Whether a `MONOIO_FORCE_LEGACY_DRIVER` value forces epoll (monoio's
/// rule: `1`, `true` or `yes`, any case).
pub fn force_legacy_set(value: Option<&str>) -> bool {
    value.is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
}

/// The `--version` line: `edge-bin 0.1.0 (commit 0123456789ab, io_uring:
/// available)`.
pub fn version_line(binary: &str, io_uring: IoUring) -> String {
    format!("{binary} {VERSION} (commit {COMMIT}, io_uring: {io_uring})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_line_names_version_commit_and_driver() {
        assert_eq!(
            version_line("edge-bin", IoUring::Available),
            format!("edge-bin {VERSION} (commit {COMMIT}, io_uring: available)")
        );
        assert_eq!(
            version_line("node-bin", IoUring::Disabled),
            format!(
                "node-bin {VERSION} (commit {COMMIT}, io_uring: disabled by \
                 MONOIO_FORCE_LEGACY_DRIVER)"
            )
        );
    }

    #[test]
    fn force_legacy_follows_monoio() {
        for on in ["1", "true", "YES", "True"] {
            assert!(force_legacy_set(Some(on)), "{on}");
        }
        for off in ["", "0", "false", "no", "2"] {
            assert!(!force_legacy_set(Some(off)), "{off}");
        }
        assert!(!force_legacy_set(None));
    }

    #[test]
    fn commit_is_a_short_hash_or_unknown() {
        assert!(
            COMMIT == "unknown"
                || (!COMMIT.is_empty() && COMMIT.bytes().all(|b| b.is_ascii_graphic())),
            "{COMMIT}"
        );
    }
}
