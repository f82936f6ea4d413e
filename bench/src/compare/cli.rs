//! `bench compare`: arguments, defaults (standard and quick), the run, the
//! table on stdout and the JSON file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use argh::FromArgs;

use super::ladder::{FULL_LEVELS, QUICK_LEVELS};
use super::report::render_table;
use super::{run, CompareOptions};
use crate::load::cli::seconds_to_ms;

/// Measure the relay against a direct connection side by side: latency
/// added (TTFT, per-chunk, gaps), CPU per relayed token, memory per stream
/// and a concurrency ladder, at each of the --concurrency levels. With
/// --peer (and --peer-pid), also a peer proxy's, and the IOP ÷ peer ratios
/// against the relay's goals (docs/bench-compare.md). Starts the mock
/// provider, edge-bin and node-bin itself; writes a JSON report.
#[derive(FromArgs, Debug, Clone, PartialEq, Default)]
#[argh(subcommand, name = "compare")]
pub struct CompareArgs {
    /// short run: shorter windows, fewer tokens, a smaller ladder (64, 128
    /// streams)
    #[argh(switch)]
    pub quick: bool,
    /// rounds, each one window per arm, order alternating (default 6;
    /// quick 3; at least 2)
    #[argh(option)]
    pub windows: Option<u32>,
    /// seconds per window (default 4; quick 2)
    #[argh(option)]
    pub window_s: Option<f64>,
    /// unmeasured warm-up seconds per arm (default 2; quick 0.5)
    #[argh(option)]
    pub warmup_s: Option<f64>,
    /// concurrency levels: comma-separated stream counts; each level runs
    /// its own rounds of windows (default 1,200, also with --quick)
    #[argh(option)]
    pub concurrency: Option<String>,
    /// tokens per request (default 32; quick 16)
    #[argh(option)]
    pub tokens: Option<u32>,
    /// mock inter-token delay in ms, also used by the ladder (default 20)
    #[argh(option, default = "20")]
    pub inter_token_ms: u64,
    /// mock time to first token in ms (default 0)
    #[argh(option, default = "0")]
    pub ttft_ms: u64,
    /// edge-bin --cores (default: the first allowed CPU)
    #[argh(option)]
    pub edge_cores: Option<String>,
    /// node-bin --cores (default: the second allowed CPU, else the first)
    #[argh(option)]
    pub node_cores: Option<String>,
    /// pin one load thread per listed core (default: one unpinned thread)
    #[argh(option)]
    pub load_cores: Option<String>,
    /// base URL of a third arm C (e.g. an nginx reverse proxy in front of
    /// the mock); requests name the mock's model
    #[argh(option)]
    pub peer: Option<String>,
    /// a process of the peer (repeatable: e.g. nginx's master and its
    /// workers) whose CPU time and memory are sampled in the peer windows;
    /// needs --peer
    #[argh(option)]
    pub peer_pid: Vec<u32>,
    /// the peer's name in the table and the goals (default peer;
    /// scripts/bench.sh --peer-nginx: nginx)
    #[argh(option)]
    pub peer_name: Option<String>,
    /// directory holding edge-bin and node-bin (default: this executable's
    /// directory)
    #[argh(option)]
    pub bin_dir: Option<PathBuf>,
    /// directory for the JSON report (default bench/results)
    #[argh(option, default = "PathBuf::from(\"bench/results\")")]
    pub out: PathBuf,
    /// use the mock provider at this URL instead of starting one
    #[argh(option)]
    pub attach_mock: Option<String>,
    /// use the Edge at this URL instead of starting edge-bin and node-bin
    /// (no CPU or memory figures then)
    #[argh(option)]
    pub attach_edge: Option<String>,
    /// port for the mock provider the harness starts (default 0: any), so
    /// a peer proxy can be configured before the run
    #[argh(option, default = "0")]
    pub mock_port: u16,
    /// model the mock serves (default mock-model)
    #[argh(option, default = "String::from(\"mock-model\")")]
    pub mock_model: String,
    /// model relayed requests name (default bench-model)
    #[argh(option, default = "String::from(\"bench-model\")")]
    pub edge_model: String,
    /// ladder levels, comma-separated stream counts, or `none` (default
    /// 256,512,1024,2048,4096,8192; quick 64,128)
    #[argh(option)]
    pub ladder: Option<String>,
    /// tokens per ladder stream (default 50; quick 25)
    #[argh(option)]
    pub ladder_tokens: Option<u32>,
    /// keep the temporary directory (configs, certificates, child logs)
    #[argh(switch)]
    pub keep_temp: bool,
}

/// `full` normally, `quick_value` in quick mode.
fn pick<T>(quick: bool, full: T, quick_value: T) -> T {
    if quick {
        quick_value
    } else {
        full
    }
}

/// The default concurrency levels of the windows, standard and quick.
pub const DEFAULT_CONCURRENCY: [u64; 2] = [1, 200];

/// Parses `--ladder`: `none`, or comma-separated positive counts.
pub fn parse_levels(text: &str) -> Result<Vec<u64>, String> {
    if text.trim().eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    parse_counts(text, "--ladder")
}

/// Parses `--concurrency`: comma-separated positive stream counts, each
/// once, in increasing order.
pub fn parse_concurrency(text: &str) -> Result<Vec<u64>, String> {
    let levels = parse_counts(text, "--concurrency")?;
    if levels.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!(
            "--concurrency: `{text}` must list each stream count once, in increasing order"
        ));
    }
    Ok(levels)
}

fn parse_counts(text: &str, option: &str) -> Result<Vec<u64>, String> {
    text.split(',')
        .map(|item| match item.trim().parse::<u64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{option}: `{item}` is not a positive stream count")),
        })
        .collect()
}

impl CompareArgs {
    /// Resolves defaults. `allowed_cpus` picks the default Edge and Node
    /// cores; `exe` is this binary.
    pub fn resolve(
        &self,
        allowed_cpus: &BTreeSet<usize>,
        exe: &Path,
    ) -> Result<CompareOptions, String> {
        let quick = self.quick;
        let windows = self.windows.unwrap_or(pick(quick, 6, 3));
        if windows < 2 {
            return Err("--windows must be at least 2".into());
        }
        let window_ms =
            seconds_to_ms(self.window_s.unwrap_or(pick(quick, 4.0, 2.0)), "--window-s")?;
        if window_ms < 100 {
            return Err("--window-s must be at least 0.1".into());
        }
        let warmup_ms =
            seconds_to_ms(self.warmup_s.unwrap_or(pick(quick, 2.0, 0.5)), "--warmup-s")?;
        let concurrency = match &self.concurrency {
            Some(text) => parse_concurrency(text)?,
            None => DEFAULT_CONCURRENCY.to_vec(),
        };
        if !self.peer_pid.is_empty() && self.peer.is_none() {
            return Err("--peer-pid needs --peer (the peer whose processes they are)".into());
        }
        if let Some(&pid) = self.peer_pid.iter().find(|&&pid| pid == 0) {
            return Err(format!("--peer-pid: `{pid}` is not a process id"));
        }
        let tokens = self.tokens.unwrap_or(pick(quick, 32, 16));
        if tokens < 2 {
            return Err("--tokens must be at least 2 (gaps need two tokens)".into());
        }
        if self.inter_token_ms == 0 {
            return Err("--inter-token-ms must be at least 1".into());
        }
        let ladder_levels = match &self.ladder {
            Some(text) => parse_levels(text)?,
            None if quick => QUICK_LEVELS.to_vec(),
            None => FULL_LEVELS.to_vec(),
        };
        let ladder_tokens = self.ladder_tokens.unwrap_or(pick(quick, 50, 25));
        if ladder_tokens < 2 {
            return Err("--ladder-tokens must be at least 2".into());
        }
        let mut cpus = allowed_cpus.iter().copied();
        let first = cpus.next().unwrap_or(0);
        let second = cpus.next().unwrap_or(first);
        let exe_dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(CompareOptions {
            quick,
            windows,
            window_ms,
            warmup_ms,
            concurrency,
            tokens,
            inter_token_ms: self.inter_token_ms,
            ttft_ms: self.ttft_ms,
            edge_cores: self.edge_cores.clone().unwrap_or_else(|| first.to_string()),
            node_cores: self
                .node_cores
                .clone()
                .unwrap_or_else(|| second.to_string()),
            load_cores: self.load_cores.clone(),
            peer: self.peer.clone(),
            peer_pids: self.peer_pid.clone(),
            peer_name: self.peer_name.clone().unwrap_or_else(|| "peer".into()),
            bin_dir: self.bin_dir.clone().unwrap_or(exe_dir),
            bench_exe: exe.to_path_buf(),
            out_dir: self.out.clone(),
            attach_mock: self.attach_mock.clone(),
            attach_edge: self.attach_edge.clone(),
            mock_port: self.mock_port,
            mock_model: self.mock_model.clone(),
            edge_model: self.edge_model.clone(),
            ladder_levels,
            ladder_tokens,
            ladder_ramp_ms: pick(quick, 1000, 250),
            keep_temp: self.keep_temp,
        })
    }
}

/// Runs `bench compare`.
pub fn main(args: CompareArgs) -> ExitCode {
    let allowed = iop_engine::rt::allowed_cpus().unwrap_or_else(|_| BTreeSet::from([0]));
    let report = crate::compare::run_command(
        "compare",
        |exe| args.resolve(&allowed, exe),
        |o: &CompareOptions| o.out_dir.as_path(),
        run,
        render_table,
    );
    match report {
        Some(_) => ExitCode::SUCCESS,
        None => ExitCode::from(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpus(list: &[usize]) -> BTreeSet<usize> {
        list.iter().copied().collect()
    }

    #[test]
    fn standard_defaults() {
        let o = CompareArgs {
            inter_token_ms: 20,
            out: "bench/results".into(),
            mock_model: "mock-model".into(),
            edge_model: "bench-model".into(),
            ..Default::default()
        }
        .resolve(&cpus(&[0, 1]), Path::new("/t/debug/bench"))
        .unwrap();
        assert_eq!(o.windows, 6);
        assert_eq!(o.window_ms, 4_000);
        assert_eq!(o.warmup_ms, 2_000);
        assert_eq!(o.concurrency, [1, 200]);
        assert!(o.peer_pids.is_empty());
        assert_eq!(o.peer_name, "peer");
        assert_eq!(o.tokens, 32);
        assert_eq!(o.ladder_levels, FULL_LEVELS);
        assert_eq!(o.ladder_tokens, 50);
        assert_eq!(o.ladder_ramp_ms, 1000);
        assert_eq!((o.edge_cores.as_str(), o.node_cores.as_str()), ("0", "1"));
        assert_eq!(o.bin_dir, PathBuf::from("/t/debug"));
        assert_eq!(o.bench_exe, PathBuf::from("/t/debug/bench"));
    }

    #[test]
    fn quick_defaults_and_overrides() {
        let args = CompareArgs {
            quick: true,
            inter_token_ms: 20,
            ..Default::default()
        };
        let o = args.resolve(&cpus(&[3]), Path::new("bench")).unwrap();
        assert_eq!(o.windows, 3);
        assert_eq!(o.window_ms, 2_000);
        assert_eq!(o.concurrency, [1, 200]);
        assert_eq!(o.ladder_levels, QUICK_LEVELS);
        assert_eq!((o.edge_cores.as_str(), o.node_cores.as_str()), ("3", "3"));
        let o = CompareArgs {
            windows: Some(2),
            window_s: Some(1.0),
            ladder: Some("none".into()),
            bin_dir: Some("/bins".into()),
            ..args.clone()
        }
        .resolve(&cpus(&[0, 1]), Path::new("/x/bench"))
        .unwrap();
        assert_eq!(o.windows, 2);
        assert_eq!(o.window_ms, 1_000);
        assert!(o.ladder_levels.is_empty());
        assert_eq!(o.bin_dir, PathBuf::from("/bins"));
    }

    #[test]
    fn bad_options_are_refused() {
        let base = CompareArgs {
            inter_token_ms: 20,
            ..Default::default()
        };
        let c = cpus(&[0]);
        let exe = Path::new("bench");
        let refuse = |a: CompareArgs| a.resolve(&c, exe).unwrap_err();
        assert_eq!(
            refuse(CompareArgs {
                windows: Some(1),
                ..base.clone()
            }),
            "--windows must be at least 2"
        );
        assert!(refuse(CompareArgs {
            tokens: Some(1),
            ..base.clone()
        })
        .contains("--tokens"));
        assert!(refuse(CompareArgs {
            concurrency: Some("0".into()),
            ..base.clone()
        })
        .contains("--concurrency"));
        assert_eq!(
            refuse(CompareArgs {
                peer_pid: vec![42],
                ..base.clone()
            }),
            "--peer-pid needs --peer (the peer whose processes they are)"
        );
        assert_eq!(
            refuse(CompareArgs {
                peer: Some("http://127.0.0.1:1".into()),
                peer_pid: vec![0],
                ..base.clone()
            }),
            "--peer-pid: `0` is not a process id"
        );
        assert!(refuse(CompareArgs {
            window_s: Some(-1.0),
            ..base.clone()
        })
        .contains("--window-s"));
        assert!(refuse(CompareArgs {
            ladder: Some("64,x".into()),
            ..base.clone()
        })
        .contains("`x`"));
        assert!(refuse(CompareArgs {
            inter_token_ms: 0,
            ..base
        })
        .contains("--inter-token-ms"));
    }

    #[test]
    fn concurrency_levels_and_peer_pids_parse_from_the_command_line() {
        let args = CompareArgs::from_args(
            &["compare"],
            &[
                "--quick",
                "--concurrency",
                "1,200",
                "--peer",
                "http://127.0.0.1:8081",
                "--peer-pid",
                "4242",
                "--peer-pid",
                "4243",
                "--peer-name",
                "nginx",
            ],
        )
        .unwrap();
        assert_eq!(args.concurrency.as_deref(), Some("1,200"));
        assert_eq!(args.peer_pid, [4242, 4243]);
        let o = args.resolve(&cpus(&[0, 1]), Path::new("/b/bench")).unwrap();
        assert_eq!(o.concurrency, [1, 200]);
        assert_eq!(o.peer_pids, [4242, 4243]);
        assert_eq!(o.peer_name, "nginx");
        assert_eq!(o.peer.as_deref(), Some("http://127.0.0.1:8081"));
        assert!(CompareArgs::from_args(&["compare"], &["--peer-pid", "x"]).is_err());
    }

    #[test]
    fn concurrency_lists_parse() {
        assert_eq!(parse_concurrency("1,200"), Ok(vec![1, 200]));
        assert_eq!(parse_concurrency(" 64 "), Ok(vec![64]));
        assert_eq!(
            parse_concurrency("1,x"),
            Err("--concurrency: `x` is not a positive stream count".into())
        );
        assert_eq!(
            parse_concurrency("200,1"),
            Err(
                "--concurrency: `200,1` must list each stream count once, in increasing order"
                    .into()
            )
        );
        assert!(parse_concurrency("1,1").is_err());
        assert!(parse_concurrency("none").is_err());
    }

    #[test]
    fn ladder_levels_parse() {
        assert_eq!(parse_levels("64, 128"), Ok(vec![64, 128]));
        assert_eq!(parse_levels("NONE"), Ok(vec![]));
        assert!(parse_levels("0").is_err());
        assert!(parse_levels("").is_err());
    }
}
