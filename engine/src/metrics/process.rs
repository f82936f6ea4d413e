//! The standard `process_*` series and `iop_build_info`, read from procfs
//! at scrape time (Linux only, as the rest of IOP).
//!
//! | series | source |
//! |---|---|
//! | `process_cpu_seconds_total` | `/proc/self/stat` utime + stime |
//! | `process_resident_memory_bytes` | `/proc/self/status` `VmRSS` |
//! | `process_open_fds` | entries of `/proc/self/fd` |
//! | `process_max_fds` | `/proc/self/limits` `Max open files` (soft) |
//! | `process_start_time_seconds` | `/proc/self/stat` starttime + `/proc/stat` `btime` |
//!
//! Clock ticks are `USER_HZ`, which Linux fixes at 100 for userspace on
//! every architecture IOP builds for (Prometheus' own `procfs` makes the
//! same assumption). A source that cannot be read leaves its series out;
//! a scrape never fails for it.

use std::fmt::Write;

use super::buckets::{escape_label_value, write_family, write_sample};

/// Clock ticks per second in `/proc/<pid>/stat`.
const USER_HZ: f64 = 100.0;

/// What procfs says of this process.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ProcessStats {
    /// User plus system CPU time, seconds.
    pub cpu_seconds: Option<f64>,
    /// Resident set size, bytes.
    pub resident_memory_bytes: Option<u64>,
    /// Open file descriptors.
    pub open_fds: Option<u64>,
    /// The soft limit on open file descriptors.
    pub max_fds: Option<u64>,
    /// Process start, Unix seconds.
    pub start_time_seconds: Option<f64>,
}

impl ProcessStats {
    /// Reads this process's stats from `/proc`.
    pub fn read() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        let stat = read("/proc/self/stat").and_then(|s| parse_stat(&s));
        let btime = read("/proc/stat").and_then(|s| parse_btime(&s));
        Self {
            cpu_seconds: stat.map(|s| (s.utime + s.stime) as f64 / USER_HZ),
            resident_memory_bytes: read("/proc/self/status").and_then(|s| parse_vm_rss(&s)),
            open_fds: std::fs::read_dir("/proc/self/fd")
                .ok()
                .map(|dir| dir.count() as u64),
            max_fds: read("/proc/self/limits").and_then(|s| parse_max_open_files(&s)),
            start_time_seconds: stat
                .zip(btime)
                .map(|(s, boot)| boot as f64 + s.starttime as f64 / USER_HZ),
        }
    }

    /// The `process_*` families, each with HELP and TYPE; a missing value
    /// leaves its family out.
    pub fn render(&self, out: &mut String) {
        let mut one = |name: &str, kind: &str, help: &str, value: Option<String>| {
            if let Some(value) = value {
                write_family(out, name, kind, help);
                write_sample(out, name, "", value);
            }
        };
        one(
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            self.cpu_seconds.map(|v| v.to_string()),
        );
        one(
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            self.resident_memory_bytes.map(|v| v.to_string()),
        );
        one(
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            self.open_fds.map(|v| v.to_string()),
        );
        one(
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            self.max_fds.map(|v| v.to_string()),
        );
        one(
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            self.start_time_seconds.map(|v| v.to_string()),
        );
    }
}

/// The fields of `/proc/<pid>/stat` used here, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// Field 14: user mode time.
    pub utime: u64,
    /// Field 15: kernel mode time.
    pub stime: u64,
    /// Field 22: start time after boot.
    pub starttime: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) may hold spaces
/// and parentheses, so fields are counted from its last `)`.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    // `rest` starts at field 3 (state).
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        utime: field(14)?,
        stime: field(15)?,
        starttime: field(22)?,
    })
}

/// `btime` (boot time, Unix seconds) of `/proc/stat`.
pub fn parse_btime(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// `VmRSS` of `/proc/<pid>/status`, in bytes.
pub fn parse_vm_rss(text: &str) -> Option<u64> {
    let value = text.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    let kib: u64 = value.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// The soft `Max open files` of `/proc/<pid>/limits` (`None` when
/// unlimited).
pub fn parse_max_open_files(text: &str) -> Option<u64> {
    let rest = text
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?;
    rest.split_ascii_whitespace().next()?.parse().ok()
}

/// The version of this build (the workspace version).
pub const BUILD_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit this build was made from ([`crate::build::COMMIT`]).
pub fn build_commit() -> &'static str {
    crate::build::COMMIT
}

/// The build and process series of this process: `iop_build_info` of
/// [`BUILD_VERSION`] and [`build_commit`], then [`ProcessStats::read`].
pub fn render_build_and_process(out: &mut String) {
    render_build_info(out, BUILD_VERSION, build_commit());
    ProcessStats::read().render(out);
}

/// `iop_build_info{version,commit} 1`.
pub fn render_build_info(out: &mut String, version: &str, commit: &str) {
    write_family(
        out,
        "iop_build_info",
        "gauge",
        "The running build: version and commit (always 1).",
    );
    let mut labels = String::new();
    let _ = write!(
        labels,
        "version=\"{}\",commit=\"{}\"",
        escape_label_value(version),
        escape_label_value(commit)
    );
    write_sample(out, "iop_build_info", &labels, 1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn procfs_fields_parse() {
        let stat = "4242 (iop edge) (x)) S 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    250 75 0 0 20 0 3 0 123456 100000000 2000 18446744073709551615";
        assert_eq!(
            parse_stat(stat),
            Some(Stat {
                utime: 250,
                stime: 75,
                starttime: 123456
            })
        );
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(
            parse_btime("cpu  1 2 3\nbtime 1700000000\nprocesses 9\n"),
            Some(1_700_000_000)
        );
        assert_eq!(
            parse_vm_rss("Name:\tedge\nVmRSS:\t   10240 kB\n"),
            Some(10_485_760)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(parse_max_open_files(limits), Some(1024));
        assert_eq!(
            parse_max_open_files("Max open files unlimited unlimited files\n"),
            None
        );
    }

    #[test]
    fn this_process_is_readable_and_renders_every_family() {
        let stats = ProcessStats::read();
        assert!(stats.open_fds.unwrap() > 0);
        assert!(stats.resident_memory_bytes.unwrap() > 0);
        assert!(stats.start_time_seconds.unwrap() > 1_600_000_000.0);
        let mut out = String::new();
        stats.render(&mut out);
        for (name, kind) in [
            ("process_cpu_seconds_total", "counter"),
            ("process_resident_memory_bytes", "gauge"),
            ("process_open_fds", "gauge"),
            ("process_max_fds", "gauge"),
            ("process_start_time_seconds", "gauge"),
        ] {
            assert!(out.contains(&format!("# TYPE {name} {kind}\n")), "{out}");
        }
        let mut info = String::new();
        render_build_info(&mut info, "0.1.0", "abc\"1");
        assert_eq!(
            info,
            "# HELP iop_build_info The running build: version and commit (always 1).\n\
             # TYPE iop_build_info gauge\n\
             iop_build_info{version=\"0.1.0\",commit=\"abc\\\"1\"} 1\n"
        );
    }
}
