//! `bench load`: arguments, the run, the summary table and JSON.

use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use argh::FromArgs;

use super::{format_us, run, Live, LoadSpec, LoadSummary, Mode, Target};
use crate::stats::LatencySummary;

/// Drive streaming chat completions at a server and report latency
/// percentiles (TTFT, per-chunk, inter-chunk gap, end to end).
#[derive(FromArgs, Debug, Clone, PartialEq)]
#[argh(subcommand, name = "load")]
pub struct LoadArgs {
    /// base URL of the server: http://host:port[/prefix]
    #[argh(option)]
    pub url: String,
    /// the model every request names
    #[argh(option)]
    pub model: String,
    /// concurrent streams kept busy, each sending its next request when the
    /// last one ends (closed loop)
    #[argh(option)]
    pub concurrency: Option<u64>,
    /// open-loop arrival rate in requests per second (`200` or `200/s`);
    /// latency is measured from each request's scheduled start
    #[argh(option, from_str_fn(parse_rate))]
    pub rate: Option<f64>,
    /// seconds during which requests start (default 10)
    #[argh(option, default = "10.0")]
    pub duration_s: f64,
    /// max_tokens of every request (default 16)
    #[argh(option, default = "16")]
    pub tokens: u32,
    /// ask for a streamed response (default true)
    #[argh(option, default = "true")]
    pub stream: bool,
    /// spread the start of the closed-loop streams over this many
    /// milliseconds (default 0)
    #[argh(option, default = "0")]
    pub ramp_ms: u64,
    /// seconds requests still in flight at the end get before they are cut
    /// off and counted as timeouts (default 30)
    #[argh(option, default = "30.0")]
    pub drain_s: f64,
    /// run one load thread per listed core, pinned (taskset syntax, e.g.
    /// `1` or `0-1`); default one unpinned thread
    #[argh(option)]
    pub cores: Option<String>,
    /// open loop: most requests in flight per load thread; a due request
    /// beyond it is not sent and counts as an error (default 10000)
    #[argh(option, default = "10_000")]
    pub max_in_flight: u64,
    /// also write the summary as JSON to this file (`-` for stdout)
    #[argh(option)]
    pub json: Option<String>,
    /// no live progress line on stderr
    #[argh(switch)]
    pub quiet: bool,
    /// send `Authorization: Bearer KEY` with every request (an Edge with
    /// `[[client_keys]]`); default: the `IOP_API_KEY` environment variable
    /// if set, else no key
    #[argh(option)]
    pub api_key: Option<String>,
}

/// Parses `R` or `R/s` into a positive, finite rate.
pub fn parse_rate(text: &str) -> Result<f64, String> {
    let number = text.trim();
    let number = number
        .strip_suffix("/s")
        .or_else(|| number.strip_suffix("/S"))
        .unwrap_or(number);
    match number.trim().parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 => Ok(rate),
        _ => Err(format!(
            "`{text}` is not a positive rate (requests per second, e.g. 200 or 200/s)"
        )),
    }
}

/// Seconds → whole milliseconds; refuses negative and non-finite values.
pub fn seconds_to_ms(seconds: f64, what: &str) -> Result<u64, String> {
    if (0.0..1e9).contains(&seconds) {
        Ok((seconds * 1000.0).round() as u64)
    } else {
        Err(format!(
            "{what}: `{seconds}` is not a number of seconds >= 0"
        ))
    }
}

/// Parses a taskset core list into one pinned thread per core.
pub fn load_cores(list: Option<&str>) -> Result<Vec<Option<usize>>, String> {
    match list {
        None => Ok(vec![None]),
        Some(text) => iop_engine::rt::CoreList::parse_for_this_process(text)
            .map(|l| l.cores().iter().copied().map(Some).collect())
            .map_err(|e| format!("--cores {text}: {e}")),
    }
}

impl LoadArgs {
    /// The run these arguments describe.
    pub fn spec(&self, stop: Arc<AtomicBool>) -> Result<LoadSpec, String> {
        let mode = match (self.concurrency, self.rate) {
            (Some(_), Some(_)) => return Err("give --concurrency or --rate, not both".into()),
            (Some(0), None) => return Err("--concurrency must be at least 1".into()),
            (Some(streams), None) => Mode::Concurrency { streams },
            (None, Some(per_s)) => Mode::Rate { per_s },
            (None, None) => return Err("give --concurrency N or --rate R/s".into()),
        };
        let target = Target::parse(&self.url).map_err(|e| format!("--url: {e}"))?;
        Ok(LoadSpec {
            target,
            model: self.model.clone(),
            mode,
            duration_ms: seconds_to_ms(self.duration_s, "--duration-s")?,
            tokens: self.tokens,
            stream: self.stream,
            ramp_ms: self.ramp_ms,
            drain_ms: seconds_to_ms(self.drain_s, "--drain-s")?,
            gap_limit_ns: None,
            cores: load_cores(self.cores.as_deref())?,
            max_in_flight: self.max_in_flight,
            progress: !self.quiet,
            stop,
            api_key: self
                .api_key
                .clone()
                .or_else(|| std::env::var("IOP_API_KEY").ok())
                .filter(|k| !k.is_empty())
                .map(|k| super::ApiKey::new(&k)),
            request_id_prefix: None,
        })
    }
}

/// Runs `bench load`.
pub fn main(args: LoadArgs) -> ExitCode {
    if let Err(e) = crate::procstat::raise_nofile_limit() {
        eprintln!("bench load: warning: {e}");
    }
    let stop = Arc::new(AtomicBool::new(false));
    crate::compare::install_stop_handlers(&stop);
    let spec = match args.spec(Arc::clone(&stop)) {
        Ok(spec) => spec,
        Err(e) => {
            eprintln!("bench load: {e}");
            return ExitCode::from(1);
        }
    };
    let live = Live::new();
    let summary = match run(&spec, &live) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bench load: {e}");
            return ExitCode::from(1);
        }
    };
    let mode = match spec.mode {
        Mode::Concurrency { streams } => format!("{streams} concurrent streams"),
        Mode::Rate { per_s } => format!("{per_s} requests/s (open loop)"),
        Mode::OneShot { streams } => format!("{streams} streams, one request each"),
    };
    println!(
        "bench load: {} model {} — {mode}, {} tokens",
        spec.target.url, spec.model, spec.tokens
    );
    print!("{}", render_summary(&summary));
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "url": spec.target.url,
            "model": spec.model,
            "mode": mode,
            "tokens": spec.tokens,
            "duration_s": args.duration_s,
            "summary": summary,
        });
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        if path == "-" {
            println!("{text}");
        } else if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("bench load: cannot write {path}: {e}");
            return ExitCode::from(1);
        }
    }
    ExitCode::SUCCESS
}

/// The human summary of one run: counts, then one row per distribution.
pub fn render_summary(s: &LoadSummary) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "  {:.1} s: {} ok of {} started ({:.1} req/s, {:.0} tokens/s, {:.2} MB/s body); errors {} \
         (connect {}, http {}, io {}, timeout {}, error events {}, overload {}); truncated {}\n",
        s.elapsed_s,
        s.requests_ok,
        s.requests_started,
        s.requests_per_s,
        s.tokens_per_s,
        s.body_bytes_per_s / 1e6,
        s.errors_total,
        s.errors.connect,
        s.errors.http_status,
        s.errors.io,
        s.errors.timeout,
        s.errors.error_event,
        s.errors.dropped_overload,
        s.truncated,
    ));
    if let Some(first) = &s.first_error {
        out.push_str(&format!("  first error: {first}\n"));
    }
    out.push_str(&format!(
        "  {:<20} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
        "", "count", "p50", "p90", "p99", "p99.9", "max"
    ));
    let row = |name: &str, l: &LatencySummary| {
        format!(
            "  {:<20} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
            name,
            l.count,
            format_us(l.p50_us),
            format_us(l.p90_us),
            format_us(l.p99_us),
            format_us(l.p999_us),
            format_us(l.max_us)
        )
    };
    out.push_str(&row("TTFT", &s.ttft));
    out.push_str(&row("chunk latency", &s.chunk_latency));
    out.push_str(&row("inter-chunk gap", &s.inter_chunk_gap));
    out.push_str(&row("end to end", &s.end_to_end));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_with_or_without_unit() {
        assert_eq!(parse_rate("200"), Ok(200.0));
        assert_eq!(parse_rate(" 12.5/s"), Ok(12.5));
        assert_eq!(parse_rate("3/S"), Ok(3.0));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("-1/s").is_err());
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("inf").is_err());
    }

    #[test]
    fn seconds_become_milliseconds() {
        assert_eq!(seconds_to_ms(1.5, "x"), Ok(1500));
        assert_eq!(seconds_to_ms(0.0, "x"), Ok(0));
        assert!(seconds_to_ms(-1.0, "--d").unwrap_err().starts_with("--d"));
        assert!(seconds_to_ms(f64::NAN, "x").is_err());
    }

    fn args() -> LoadArgs {
        LoadArgs {
            url: "http://127.0.0.1:9".into(),
            model: "m".into(),
            concurrency: None,
            rate: None,
            duration_s: 1.0,
            tokens: 4,
            stream: true,
            ramp_ms: 0,
            drain_s: 2.0,
            cores: None,
            max_in_flight: 5,
            json: None,
            quiet: true,
            api_key: None,
        }
    }

    #[test]
    fn the_api_key_becomes_a_bearer_header_and_stays_out_of_debug() {
        let stop = Arc::new(AtomicBool::new(false));
        let keyed = LoadArgs {
            concurrency: Some(1),
            api_key: Some("sk-secret".into()),
            ..args()
        };
        let spec = keyed.spec(stop).unwrap();
        let key = spec.api_key.as_ref().unwrap();
        assert_eq!(key.authorization(), "Bearer sk-secret");
        assert!(!format!("{spec:?}").contains("sk-secret"));
    }

    #[test]
    fn mode_needs_exactly_one_of_concurrency_and_rate() {
        let stop = Arc::new(AtomicBool::new(false));
        assert!(args().spec(stop.clone()).is_err());
        let both = LoadArgs {
            concurrency: Some(2),
            rate: Some(1.0),
            ..args()
        };
        assert_eq!(
            both.spec(stop.clone()).unwrap_err(),
            "give --concurrency or --rate, not both"
        );
        let conc = LoadArgs {
            concurrency: Some(2),
            ..args()
        };
        let spec = conc.spec(stop.clone()).unwrap();
        assert_eq!(spec.mode, Mode::Concurrency { streams: 2 });
        assert_eq!(spec.duration_ms, 1000);
        assert_eq!(spec.drain_ms, 2000);
        assert_eq!(spec.cores, vec![None]);
        let rate = LoadArgs {
            rate: Some(50.0),
            ..args()
        };
        assert_eq!(rate.spec(stop).unwrap().mode, Mode::Rate { per_s: 50.0 });
    }
}
