//! `bench bodies`: the Edge's memory under large request bodies.
//!
//! ```text
//! N client threads ─► POST /v1/chat/completions (M tiny messages each) ─► edge-bin ══► node-bin ─► mock
//!        all at once                    sampler: Edge VmRSS every 2 ms, VmHWM (reset before each burst)
//! ```
//!
//! Starts a mock provider, an Edge and a Node (as `bench compare` does), then
//! runs bursts: `--requests` concurrent chat completions whose bodies carry
//! `--messages` tiny messages each (by default 6 × 220,000 messages, about
//! 7.2 MB each: the shape that used to take the Edge from 10 MiB to 1 GiB).
//! Per burst it records the Edge's resident set size before, the peak
//! during (the larger of the sampled maximum and the kernel's `VmHWM`,
//! reset before the burst) and after (`--settle-s` after the last answer),
//! and every answer's status. The report gives `peak ÷ (N × body)` and
//! `(peak − before) ÷ (N × body)`: how many bytes of Edge memory each body
//! byte cost at the worst moment.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use argh::FromArgs;
use serde::Serialize;

use crate::compare::config::{edge_toml_with, ClusterNames};
use crate::compare::procs::{ChildProc, TempDir};
use crate::compare::run::{check_binary, commit, interrupted, spawn_relay, RelaySpec};
use crate::compare::{install_stop_handlers, write_json_report, CompareError};
use crate::procstat::{self, MachineInfo};

/// The JSON report's schema name.
pub const SCHEMA: &str = "iop-bench-bodies/1";

/// Measure the Edge's memory under bursts of large chat bodies: before,
/// peak and after each burst, and peak per body byte. Writes a JSON report.
/// Exits 1 if any request was not answered 200.
#[derive(FromArgs, Debug, Clone, PartialEq)]
#[argh(subcommand, name = "bodies")]
pub struct BodiesArgs {
    /// concurrent requests per burst (default 6)
    #[argh(option, default = "6")]
    pub requests: usize,
    /// messages in each request body (default 220000)
    #[argh(option, default = "220_000")]
    pub messages: usize,
    /// bursts (default 3)
    #[argh(option, default = "3")]
    pub bursts: u32,
    /// seconds to wait after a burst before the "after" sample (default 3)
    #[argh(option, default = "3.0")]
    pub settle_s: f64,
    /// the Edge's `edge.max_json_elements` (default 1000000: the default
    /// 250000 refuses the 220,000-message bodies)
    #[argh(option, default = "1_000_000")]
    pub max_json_elements: u64,
    /// directory holding edge-bin and node-bin (default: this executable's
    /// directory)
    #[argh(option)]
    pub bin_dir: Option<PathBuf>,
    /// directory for the JSON report (default bench/results)
    #[argh(option, default = "PathBuf::from(\"bench/results\")")]
    pub out: PathBuf,
    /// keep the temporary directory (configs, certificates, child logs)
    #[argh(switch)]
    pub keep_temp: bool,
}

/// One burst's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Burst {
    /// Edge RSS just before the burst, KiB.
    pub before_kib: u64,
    /// Edge peak RSS during the burst, KiB.
    pub peak_kib: u64,
    /// Edge RSS `settle_s` after the last answer, KiB.
    pub after_kib: u64,
    /// The status of every answer (0: no answer).
    pub statuses: Vec<u16>,
    /// Wall time from the start of the burst to the last answer, ms.
    pub elapsed_ms: u64,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct BodiesReport {
    /// [`SCHEMA`].
    pub schema: &'static str,
    /// The machine.
    pub machine: MachineInfo,
    /// `git rev-parse --short HEAD`, when available.
    pub commit: Option<String>,
    /// The options.
    pub requests: usize,
    /// Messages per body.
    pub messages: usize,
    /// Bytes of each request body.
    pub body_bytes: usize,
    /// Edge RSS once started (after one small warm-up request), KiB.
    pub idle_kib: u64,
    /// Every burst.
    pub bursts: Vec<Burst>,
    /// Largest `peak ÷ (requests × body)` over the bursts.
    pub peak_per_body_byte: f64,
    /// Largest `(peak − before) ÷ (requests × body)` over the bursts.
    pub growth_per_body_byte: f64,
    /// The Edge's allocator environment (`MALLOC_*`), as inherited.
    pub malloc_env: Vec<String>,
}

/// A chat completions body of `messages` tiny user messages.
pub fn body(messages: usize) -> String {
    let mut out =
        String::from(r#"{"model":"bench-model","stream":false,"max_tokens":1,"messages":["#);
    for i in 0..messages {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&format!(r#"{{"role":"user","content":"m{i}"}}"#));
    }
    out.push_str("]}");
    out
}

/// Sends one request and reads the answer to its end; the status, or 0.
fn post(addr: SocketAddr, body: &[u8]) -> u16 {
    let exchange = || -> std::io::Result<Vec<u8>> {
        let mut tcp = TcpStream::connect(addr)?;
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        tcp.write_all(head.as_bytes())?;
        tcp.write_all(body)?;
        let mut answer = Vec::new();
        tcp.read_to_end(&mut answer)?;
        Ok(answer)
    };
    exchange()
        .ok()
        .and_then(|raw| {
            let line = raw.split(|&b| b == b'\r').next()?;
            std::str::from_utf8(line)
                .ok()?
                .split(' ')
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// Runs one burst of `requests` concurrent posts while sampling the Edge.
fn burst(pid: u32, addr: SocketAddr, body: &Arc<Vec<u8>>, requests: usize) -> Burst {
    let before_kib = procstat::read_rss_kib(pid).unwrap_or(0);
    let _ = procstat::reset_peak_rss(pid);
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while !done.load(Ordering::Relaxed) {
                peak = peak.max(procstat::read_rss_kib(pid).unwrap_or(0));
                std::thread::sleep(Duration::from_millis(2));
            }
            peak
        })
    };
    let started = iop_engine::clock::now();
    let barrier = Arc::new(Barrier::new(requests));
    let clients: Vec<_> = (0..requests)
        .map(|_| {
            let (body, barrier) = (body.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                post(addr, &body)
            })
        })
        .collect();
    let statuses = clients.into_iter().map(|c| c.join().unwrap_or(0)).collect();
    let elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    done.store(true, Ordering::Relaxed);
    let sampled = sampler.join().unwrap_or(0);
    let hwm = procstat::read_peak_rss_kib(pid).unwrap_or(0);
    Burst {
        before_kib,
        peak_kib: sampled.max(hwm),
        after_kib: 0,
        statuses,
        elapsed_ms,
    }
}

/// Runs the whole measurement. Progress goes to stderr.
pub fn run(args: &BodiesArgs, stop: &Arc<AtomicBool>) -> Result<BodiesReport, CompareError> {
    if args.requests == 0 || args.bursts == 0 {
        return Err(CompareError::Options(
            "--requests and --bursts must be at least 1".into(),
        ));
    }
    let exe = std::env::current_exe().map_err(|source| CompareError::Io {
        what: "find this executable".into(),
        source,
    })?;
    let bin_dir = match &args.bin_dir {
        Some(dir) => dir.clone(),
        None => exe.parent().map(PathBuf::from).unwrap_or_default(),
    };
    let tmp = TempDir::create(args.keep_temp)?;
    let names = ClusterNames::bench("bench-model", "mock-model");
    check_binary(&exe)?;
    let mock_args: Vec<String> = [
        "mock-provider",
        "--port",
        "0",
        "--tokens",
        "1",
        "--model-list",
        "mock-model",
    ]
    .map(String::from)
    .to_vec();
    let mut mock = ChildProc::spawn("mock", &exe, &mock_args, tmp.path(), true, stop)?;
    let mock_url = format!("http://{}", mock.ready_value("addr")?);
    let edge_keys = format!("max_json_elements = {}\n", args.max_json_elements);
    let edge_config = edge_toml_with(&names, &mock_url, &edge_keys);
    let spec = RelaySpec {
        names: &names,
        edge_config: &edge_config,
        cores: ("0", "0"),
        status_key: None,
    };
    let relay = spawn_relay(
        &bin_dir,
        &tmp.path().join("relay"),
        &spec,
        stop,
        &mut || mock.check_running(),
    )?;
    let addr: SocketAddr = relay
        .url
        .trim_start_matches("http://")
        .parse()
        .map_err(|e| CompareError::Options(format!("edge address {}: {e}", relay.url)))?;
    let pid = relay.edge.pid();
    // One small request first, so "idle" includes what serving costs.
    let warm = post(addr, body(1).as_bytes());
    if warm != 200 {
        return Err(CompareError::Options(format!(
            "the warm-up request got status {warm}; see the logs with --keep-temp"
        )));
    }
    std::thread::sleep(Duration::from_millis(200));
    let idle_kib = procstat::read_rss_kib(pid)?;
    let text = body(args.messages);
    let body_bytes = text.len();
    let body = Arc::new(text.into_bytes());
    eprintln!(
        "bench bodies: {} requests x {} messages ({:.1} MiB each), edge idle {:.1} MiB",
        args.requests,
        args.messages,
        body_bytes as f64 / MIB,
        idle_kib as f64 / 1024.0
    );
    let mut bursts = Vec::new();
    for i in 0..args.bursts {
        interrupted(stop)?;
        let mut b = burst(pid, addr, &body, args.requests);
        std::thread::sleep(Duration::from_secs_f64(args.settle_s.max(0.0)));
        b.after_kib = procstat::read_rss_kib(pid)?;
        eprintln!(
            "burst {}/{}: before {:.1} MiB, peak {:.1} MiB, after {:.1} MiB, {} ms, statuses {:?}",
            i + 1,
            args.bursts,
            b.before_kib as f64 / 1024.0,
            b.peak_kib as f64 / 1024.0,
            b.after_kib as f64 / 1024.0,
            b.elapsed_ms,
            b.statuses
        );
        bursts.push(b);
    }
    let offered = (args.requests * body_bytes) as f64;
    let worst = |f: fn(&Burst) -> u64| {
        bursts
            .iter()
            .map(|b| f(b) as f64 * 1024.0 / offered)
            .fold(0.0, f64::max)
    };
    let malloc_env = std::env::vars()
        .filter(|(k, _)| k.starts_with("MALLOC_") || k == "GLIBC_TUNABLES")
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    Ok(BodiesReport {
        schema: SCHEMA,
        machine: procstat::machine_info(),
        commit: commit(),
        requests: args.requests,
        messages: args.messages,
        body_bytes,
        idle_kib,
        peak_per_body_byte: worst(|b| b.peak_kib),
        growth_per_body_byte: worst(|b| b.peak_kib.saturating_sub(b.before_kib)),
        bursts,
        malloc_env,
    })
}

const MIB: f64 = 1024.0 * 1024.0;

/// The table printed on stdout.
pub fn render_table(report: &BodiesReport) -> String {
    let mut out = format!(
        "bench bodies: {} concurrent x {:.2} MiB ({} messages); edge idle {:.1} MiB\n\
         burst  before MiB  peak MiB  after MiB  ms      statuses\n",
        report.requests,
        report.body_bytes as f64 / MIB,
        report.messages,
        report.idle_kib as f64 / 1024.0
    );
    for (i, b) in report.bursts.iter().enumerate() {
        out.push_str(&format!(
            "{:<6} {:>10.1} {:>9.1} {:>10.1}  {:<7} {:?}\n",
            i + 1,
            b.before_kib as f64 / 1024.0,
            b.peak_kib as f64 / 1024.0,
            b.after_kib as f64 / 1024.0,
            b.elapsed_ms,
            b.statuses
        ));
    }
    out.push_str(&format!(
        "peak / (N x body) = {:.2}; (peak - before) / (N x body) = {:.2}\n",
        report.peak_per_body_byte, report.growth_per_body_byte
    ));
    out
}

/// `bench bodies`.
pub fn main(args: BodiesArgs) -> ExitCode {
    let stop = Arc::new(AtomicBool::new(false));
    install_stop_handlers(&stop);
    let report = match run(&args, &stop) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("bench bodies: {e}");
            return ExitCode::from(1);
        }
    };
    print!("{}", render_table(&report));
    let unix_sec = iop_engine::clock::unix_ms() / 1000;
    match write_json_report(&args.out, "bodies", unix_sec, &report) {
        Ok(path) => println!("JSON report: {}", path.display()),
        Err(e) => {
            eprintln!("bench bodies: {e}");
            return ExitCode::from(1);
        }
    }
    let all_ok = report
        .bursts
        .iter()
        .all(|b| b.statuses.iter().all(|&s| s == 200));
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_valid_chat_requests_of_the_asked_size() {
        let text = body(3);
        assert_eq!(
            text,
            r#"{"model":"bench-model","stream":false,"max_tokens":1,"messages":[{"role":"user","content":"m0"},{"role":"user","content":"m1"},{"role":"user","content":"m2"}]}"#
        );
        let parsed: serde_json::Value = serde_json::from_str(&body(220_000)).unwrap();
        assert_eq!(parsed["messages"].as_array().map(Vec::len), Some(220_000));
        // The shape the issue measured: about 7 MB, under the 8 MiB limit.
        let len = body(220_000).len();
        assert!((7_000_000..8 * 1024 * 1024).contains(&len), "{len}");
    }
}
