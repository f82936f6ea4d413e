//! What the comparison reads about processes and the machine from `/proc`:
//! CPU time (`utime + stime` of `/proc/<pid>/stat`, in clock ticks),
//! resident memory (`VmRSS` of `/proc/<pid>/status`), the kernel release,
//! the CPU model, and the file-descriptor limit (raised to the hard limit
//! so thousands of streams fit).
//!
//! The parsers are pure functions over the file text; the `read_*`
//! functions only add the file read.

use std::fs;
use std::io;

use nix::sys::resource::{getrlimit, setrlimit, Resource};
use nix::unistd::{sysconf, SysconfVar};

/// Why a `/proc` figure could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// The file could not be read (the process may have exited).
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        source: io::Error,
    },
    /// The file's text is not in the expected format.
    #[error("unexpected format of {what}: {reason}")]
    Format {
        /// Which file or line.
        what: &'static str,
        /// What was wrong.
        reason: &'static str,
    },
    /// A system call failed.
    #[error("{call} failed: {source}")]
    Sys {
        /// The call.
        call: &'static str,
        /// The errno.
        source: nix::Error,
    },
}

/// CPU time a process has used, in clock ticks (`sysconf(_SC_CLK_TCK)`
/// per second), all threads together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuTicks {
    /// Time in user mode (field 14 of `/proc/<pid>/stat`).
    pub utime_ticks: u64,
    /// Time in kernel mode (field 15).
    pub stime_ticks: u64,
}

impl CpuTicks {
    /// `utime + stime`.
    pub fn total_ticks(self) -> u64 {
        self.utime_ticks.saturating_add(self.stime_ticks)
    }

    /// Ticks used since `earlier` (0 if the counters went backwards, which
    /// only a different process could cause).
    pub fn since(self, earlier: CpuTicks) -> u64 {
        self.total_ticks().saturating_sub(earlier.total_ticks())
    }
}

/// Parses the one line of `/proc/<pid>/stat`. The second field, the
/// command name in parentheses, may itself contain spaces and
/// parentheses, so the fields are counted from the *last* `)`.
pub fn parse_stat_cpu(line: &str) -> Result<CpuTicks, ProcError> {
    const WHAT: &str = "/proc/<pid>/stat";
    let close = line.rfind(')').ok_or(ProcError::Format {
        what: WHAT,
        reason: "no `)` closing the command name",
    })?;
    // After the name: field 3 (state) is index 0, so field N is N - 3.
    let fields: Vec<&str> = line[close + 1..].split_ascii_whitespace().collect();
    let field = |n: usize| -> Result<u64, ProcError> {
        fields
            .get(n - 3)
            .ok_or(ProcError::Format {
                what: WHAT,
                reason: "fewer than 15 fields",
            })?
            .parse::<u64>()
            .map_err(|_| ProcError::Format {
                what: WHAT,
                reason: "utime/stime is not a number",
            })
    };
    Ok(CpuTicks {
        utime_ticks: field(14)?,
        stime_ticks: field(15)?,
    })
}

/// Parses `VmRSS:  <n> kB` out of `/proc/<pid>/status`, in KiB.
pub fn parse_vm_rss_kib(status: &str) -> Result<u64, ProcError> {
    parse_status_kib(status, "VmRSS:")
}

/// Parses `VmHWM:  <n> kB` (peak resident set size since start or since
/// the last [`reset_peak_rss`]) out of `/proc/<pid>/status`, in KiB.
pub fn parse_vm_hwm_kib(status: &str) -> Result<u64, ProcError> {
    parse_status_kib(status, "VmHWM:")
}

fn parse_status_kib(status: &str, key: &'static str) -> Result<u64, ProcError> {
    const WHAT: &str = "/proc/<pid>/status";
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .ok_or(ProcError::Format {
            what: WHAT,
            reason: "no VmRSS/VmHWM line (a kernel thread or a zombie?)",
        })?;
    let mut parts = line.split_ascii_whitespace();
    let value = parts
        .next()
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or(ProcError::Format {
            what: WHAT,
            reason: "VmRSS/VmHWM value is not a number",
        })?;
    match parts.next() {
        Some("kB") => Ok(value),
        _ => Err(ProcError::Format {
            what: WHAT,
            reason: "VmRSS/VmHWM unit is not kB",
        }),
    }
}

/// Peak resident set size of process `pid` (`VmHWM`), in KiB.
pub fn read_peak_rss_kib(pid: u32) -> Result<u64, ProcError> {
    parse_vm_hwm_kib(&read(format!("/proc/{pid}/status"))?)
}

/// Resets process `pid`'s peak resident set size (`VmHWM`) to its current
/// size (`echo 5 > /proc/<pid>/clear_refs`).
pub fn reset_peak_rss(pid: u32) -> Result<(), ProcError> {
    let path = format!("/proc/{pid}/clear_refs");
    fs::write(&path, "5").map_err(|source| ProcError::Read { path, source })
}

/// The `model name` of the first processor in `/proc/cpuinfo`.
pub fn parse_cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == "model name").then(|| value.trim().to_string())
    })
}

fn read(path: String) -> Result<String, ProcError> {
    fs::read_to_string(&path).map_err(|source| ProcError::Read { path, source })
}

/// The text of a `/proc/<pid>/cmdline`: the NUL-separated arguments joined
/// by spaces, the program named by its file name rather than its path (so
/// the arguments that tell processes apart survive the cut wherever the
/// binary lives), cut to `max_chars` characters with `…`. A process that
/// rewrote its title, as nginx does, shows that title as it wrote it.
/// `None` when empty (a kernel thread or a zombie).
pub fn parse_cmdline(raw: &[u8], max_chars: usize) -> Option<String> {
    let text = String::from_utf8_lossy(raw);
    let mut args = text
        .split('\0')
        .map(str::trim)
        .filter(|arg| !arg.is_empty());
    let program = args.next()?;
    let program = match program.rsplit_once('/') {
        Some((_, name)) if !name.is_empty() && !program.contains(char::is_whitespace) => name,
        _ => program,
    };
    let joined = std::iter::once(program)
        .chain(args)
        .collect::<Vec<_>>()
        .join(" ");
    if joined.chars().count() <= max_chars {
        return Some(joined);
    }
    let cut: String = joined.chars().take(max_chars.saturating_sub(1)).collect();
    Some(format!("{}…", cut.trim_end()))
}

/// [`parse_cmdline`] of process `pid`; `None` if it is not running.
pub fn read_cmdline(pid: u32, max_chars: usize) -> Option<String> {
    parse_cmdline(&fs::read(format!("/proc/{pid}/cmdline")).ok()?, max_chars)
}

/// CPU ticks used so far by process `pid`.
pub fn read_cpu(pid: u32) -> Result<CpuTicks, ProcError> {
    parse_stat_cpu(&read(format!("/proc/{pid}/stat"))?)
}

/// Parses `/proc/<pid>/task/<tid>/schedstat`: its first field is the
/// time the thread ran on a CPU, in nanoseconds.
pub fn parse_schedstat_ns(text: &str) -> Result<u64, ProcError> {
    text.split_ascii_whitespace()
        .next()
        .and_then(|f| f.parse().ok())
        .ok_or(ProcError::Format {
            what: "/proc/<pid>/task/<tid>/schedstat",
            reason: "no run time in nanoseconds first",
        })
}

/// CPU time process `pid` has used so far, in nanoseconds, all threads
/// together (`schedstat`: nanosecond resolution, where `stat`'s clock
/// ticks are 10 ms). Threads that exited are not counted, so compare
/// readings of a process whose threads live for its whole life.
pub fn read_cpu_ns(pid: u32) -> Result<u64, ProcError> {
    let dir = format!("/proc/{pid}/task");
    let tasks = fs::read_dir(&dir).map_err(|source| ProcError::Read {
        path: dir.clone(),
        source,
    })?;
    let mut total_ns = 0u64;
    for task in tasks.flatten() {
        let path = task.path().join("schedstat");
        match fs::read_to_string(&path) {
            Ok(text) => total_ns = total_ns.saturating_add(parse_schedstat_ns(&text)?),
            // The thread ended between the listing and the read.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(ProcError::Read {
                    path: path.display().to_string(),
                    source,
                })
            }
        }
    }
    Ok(total_ns)
}

/// Resident set size of process `pid`, in KiB.
pub fn read_rss_kib(pid: u32) -> Result<u64, ProcError> {
    parse_vm_rss_kib(&read(format!("/proc/{pid}/status"))?)
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`, 100 on most Linux).
pub fn clock_ticks_per_s() -> Result<u64, ProcError> {
    match sysconf(SysconfVar::CLK_TCK) {
        Ok(Some(ticks)) if ticks > 0 => Ok(ticks as u64),
        Ok(_) => Err(ProcError::Format {
            what: "sysconf(_SC_CLK_TCK)",
            reason: "no positive value",
        }),
        Err(source) => Err(ProcError::Sys {
            call: "sysconf(_SC_CLK_TCK)",
            source,
        }),
    }
}

/// `ticks` clock ticks in microseconds at `ticks_per_s`.
pub fn ticks_to_us(ticks: u64, ticks_per_s: u64) -> u64 {
    if ticks_per_s == 0 {
        return 0;
    }
    let us = u128::from(ticks) * 1_000_000 / u128::from(ticks_per_s);
    u64::try_from(us).unwrap_or(u64::MAX)
}

/// The open-file limit after [`raise_nofile_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct NofileLimit {
    /// The soft limit before raising.
    pub soft_before: u64,
    /// The soft limit now (children started after this inherit it).
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
}

/// Raises this process's `RLIMIT_NOFILE` soft limit to the hard limit.
pub fn raise_nofile_limit() -> Result<NofileLimit, ProcError> {
    let (soft_before, hard) =
        getrlimit(Resource::RLIMIT_NOFILE).map_err(|source| ProcError::Sys {
            call: "getrlimit(RLIMIT_NOFILE)",
            source,
        })?;
    if soft_before < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(|source| ProcError::Sys {
            call: "setrlimit(RLIMIT_NOFILE)",
            source,
        })?;
    }
    Ok(NofileLimit {
        soft_before,
        soft: hard.max(soft_before),
        hard,
    })
}

/// Parses `/proc/loadavg` into its 1, 5 and 15 minute load averages.
pub fn parse_loadavg(text: &str) -> Option<[f64; 3]> {
    let mut fields = text.split_ascii_whitespace().map(str::parse::<f64>);
    Some([
        fields.next()?.ok()?,
        fields.next()?.ok()?,
        fields.next()?.ok()?,
    ])
}

/// The machine's load averages now (runnable tasks, 1/5/15 min): on a
/// shared machine, how much the figures had to compete for the CPUs.
pub fn read_loadavg() -> Option<[f64; 3]> {
    parse_loadavg(&fs::read_to_string("/proc/loadavg").ok()?)
}

/// Facts about the machine a report was measured on.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MachineInfo {
    /// CPUs this process may run on.
    pub nproc: usize,
    /// `/proc/sys/kernel/osrelease`, or `"unknown"`.
    pub kernel: String,
    /// The first `model name` of `/proc/cpuinfo`, or `"unknown"`.
    pub cpu_model: String,
    /// The monoio driver this machine gets (`io_uring` or `legacy (epoll)`).
    pub driver: String,
    /// Number of local ports for outgoing connections
    /// (`/proc/sys/net/ipv4/ip_local_port_range`), if readable.
    pub local_ports: Option<u64>,
}

/// Parses `ip_local_port_range` (`"32768\t60999"`) into a port count.
pub fn parse_port_range(text: &str) -> Option<u64> {
    let mut parts = text.split_ascii_whitespace();
    let low: u64 = parts.next()?.parse().ok()?;
    let high: u64 = parts.next()?.parse().ok()?;
    (high >= low).then(|| high - low + 1)
}

/// Reads [`MachineInfo`]; missing files give `"unknown"`.
pub fn machine_info() -> MachineInfo {
    let nproc = iop_engine::rt::allowed_cpus()
        .map(|set| set.len())
        .unwrap_or_else(|_| std::thread::available_parallelism().map_or(1, |n| n.get()));
    MachineInfo {
        nproc,
        kernel: fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into()),
        cpu_model: fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| parse_cpu_model(&s))
            .unwrap_or_else(|| "unknown".into()),
        driver: iop_engine::rt::detect_driver().to_string(),
        local_ports: fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| parse_port_range(&s)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_are_joined_and_shortened() {
        assert_eq!(
            parse_cmdline(b"nginx: worker process\0\0\0", 40).as_deref(),
            Some("nginx: worker process")
        );
        assert_eq!(
            parse_cmdline(b"/usr/sbin/nginx\0-p\0/tmp/w\0", 40).as_deref(),
            Some("nginx -p /tmp/w")
        );
        // A long build path does not push the distinguishing arguments out.
        assert_eq!(
            parse_cmdline(
                b"/check/work/main/target/debug/bench\0mock-provider\0--port\09\0",
                24
            )
            .as_deref(),
            Some("bench mock-provider --p…")
        );
        // A rewritten title with a path inside it is kept as written.
        assert_eq!(
            parse_cmdline(b"nginx: master process /usr/sbin/nginx", 60).as_deref(),
            Some("nginx: master process /usr/sbin/nginx")
        );
        assert_eq!(
            parse_cmdline(b"nginx: master process nginx -p /tmp/x", 14).as_deref(),
            Some("nginx: master…")
        );
        assert_eq!(parse_cmdline(b"", 40), None);
        assert_eq!(parse_cmdline(b"\0\0", 40), None);
    }

    #[test]
    fn load_averages_are_the_first_three_fields() {
        assert_eq!(
            parse_loadavg("6.90 6.10 6.40 10/139 11612\n"),
            Some([6.9, 6.1, 6.4])
        );
        assert_eq!(parse_loadavg("1.0 2.0"), None);
        assert_eq!(parse_loadavg("x 1 2"), None);
    }

    #[test]
    fn schedstat_run_time_is_the_first_field() {
        assert_eq!(
            parse_schedstat_ns("123456789 2000 17\n").unwrap(),
            123_456_789
        );
        assert!(parse_schedstat_ns("").is_err());
        assert!(parse_schedstat_ns("x 1 2").is_err());
        // This process's own threads have run.
        assert!(read_cpu_ns(std::process::id()).unwrap() > 0);
    }

    #[test]
    fn stat_line_with_a_plain_name() {
        let line = "4242 (edge-bin) S 1 4242 4242 0 -1 4194560 1510 0 0 0 \
                    731 93 0 0 20 0 1 0 12345 98765432 2048 18446744073709551615";
        assert_eq!(
            parse_stat_cpu(line).unwrap(),
            CpuTicks {
                utime_ticks: 731,
                stime_ticks: 93
            }
        );
    }

    #[test]
    fn stat_line_with_spaces_and_parentheses_in_the_name() {
        // A process may name itself anything up to 15 bytes, `)` included.
        let line = "77 (we ird) (x) R 1 77 77 0 -1 4194304 10 0 0 0 \
                    5 7 0 0 20 0 3 0 99 1000 10 18446744073709551615\n";
        let cpu = parse_stat_cpu(line).unwrap();
        assert_eq!(
            cpu,
            CpuTicks {
                utime_ticks: 5,
                stime_ticks: 7
            }
        );
        assert_eq!(cpu.total_ticks(), 12);
        assert_eq!(
            cpu.since(CpuTicks {
                utime_ticks: 1,
                stime_ticks: 1
            }),
            10
        );
        assert_eq!(CpuTicks::default().since(cpu), 0);
    }

    #[test]
    fn stat_line_errors() {
        assert!(matches!(
            parse_stat_cpu("12 no-parens S 1"),
            Err(ProcError::Format { reason, .. }) if reason.contains(")")
        ));
        assert!(matches!(
            parse_stat_cpu("12 (short) S 1 2 3"),
            Err(ProcError::Format { reason, .. }) if reason.contains("fewer")
        ));
        assert!(matches!(
            parse_stat_cpu("1 (x) S 1 1 1 0 -1 0 0 0 0 0 abc 1 0"),
            Err(ProcError::Format { reason, .. }) if reason.contains("number")
        ));
    }

    #[test]
    fn vm_rss_is_read_in_kib() {
        let status = "Name:\tnode-bin\nState:\tS (sleeping)\nVmPeak:\t  200000 kB\n\
                      VmRSS:\t   12345 kB\nRssAnon:\t    8000 kB\n";
        assert_eq!(parse_vm_rss_kib(status).unwrap(), 12345);
        assert!(parse_vm_rss_kib("Name:\tkthreadd\n").is_err());
        assert!(parse_vm_rss_kib("VmRSS:\t 12 MB\n").is_err());
        assert!(parse_vm_rss_kib("VmRSS:\t lots kB\n").is_err());
    }

    #[test]
    fn ticks_convert_to_microseconds() {
        assert_eq!(ticks_to_us(0, 100), 0);
        assert_eq!(ticks_to_us(1, 100), 10_000);
        assert_eq!(ticks_to_us(250, 100), 2_500_000);
        assert_eq!(ticks_to_us(3, 1000), 3_000);
        assert_eq!(ticks_to_us(5, 0), 0);
        assert_eq!(ticks_to_us(u64::MAX, 1), u64::MAX);
    }

    #[test]
    fn cpu_model_and_port_range() {
        let cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n\
                       processor\t: 1\nmodel name\t: AMD EPYC 7B13\n";
        assert_eq!(parse_cpu_model(cpuinfo).as_deref(), Some("AMD EPYC 7B13"));
        assert_eq!(parse_cpu_model("processor : 0\n"), None);
        assert_eq!(parse_port_range("32768\t60999\n"), Some(28232));
        assert_eq!(parse_port_range("5 4"), None);
        assert_eq!(parse_port_range("x"), None);
    }

    #[test]
    fn own_process_figures_are_readable() {
        let pid = std::process::id();
        read_cpu(pid).unwrap();
        assert!(read_rss_kib(pid).unwrap() > 0);
        assert!(clock_ticks_per_s().unwrap() > 0);
    }
}
