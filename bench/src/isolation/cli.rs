//! `bench isolation`: arguments, defaults (standard and quick), the run, the
//! table on stdout and the JSON file.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use argh::FromArgs;

use super::report::render_table;
use super::{run, IsolationOptions};
use crate::load::cli::seconds_to_ms;

/// Measure what clients that never read cost the other clients of the same
/// node connection: normal streams' added per-chunk latency with and
/// without K never-readers, the relay's memory per stuck run, how soon each
/// never-reader is cut off, and the back-pressure the provider saw. Writes
/// a JSON report; exits 1 if a normal stream failed, a never-reader was not
/// cut off or a lease was not returned.
#[derive(FromArgs, Debug, Clone, PartialEq, Default)]
#[argh(subcommand, name = "isolation")]
pub struct IsolationArgs {
    /// short run: fewer rounds, shorter windows, a shorter cut-off
    #[argh(switch)]
    pub quick: bool,
    /// rounds (default 3; quick 1)
    #[argh(option)]
    pub rounds: Option<u32>,
    /// seconds per window (default 5; quick 2)
    #[argh(option)]
    pub window_s: Option<f64>,
    /// normal concurrent streams (default 10)
    #[argh(option, default = "10")]
    pub normal_streams: u64,
    /// clients that never read (default 10)
    #[argh(option, default = "10")]
    pub never_readers: u32,
    /// content tokens per normal stream (default 64)
    #[argh(option, default = "64")]
    pub normal_tokens: u32,
    /// milliseconds between a normal stream's tokens (default 20)
    #[argh(option, default = "20")]
    pub inter_token_ms: u64,
    /// bytes of the answer a never-reader asks for (default 16 MiB)
    #[argh(option, default = "16 * 1024 * 1024")]
    pub bulk_bytes: u64,
    /// the Edge's flow_window_bytes (default 262144)
    #[argh(option, default = "256 * 1024")]
    pub flow_window_bytes: u64,
    /// the Edge's client_write_stall_timeout_ms (default: long enough for
    /// window B, 3 × the window + 2 s)
    #[argh(option)]
    pub stall_timeout_ms: Option<u64>,
    /// the --cores of edge-bin (default 0)
    #[argh(option, default = "String::from(\"0\")")]
    pub edge_cores: String,
    /// the --cores of node-bin (default 0)
    #[argh(option, default = "String::from(\"0\")")]
    pub node_cores: String,
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

impl IsolationArgs {
    /// Resolves defaults; `exe` is this binary.
    pub fn resolve(&self, exe: &Path) -> Result<IsolationOptions, String> {
        let quick = self.quick;
        let rounds = self.rounds.unwrap_or(if quick { 1 } else { 3 });
        if rounds == 0 {
            return Err("--rounds must be at least 1".into());
        }
        let window_ms = seconds_to_ms(
            self.window_s.unwrap_or(if quick { 2.0 } else { 5.0 }),
            "--window-s",
        )?;
        if window_ms < 500 {
            return Err("--window-s must be at least 0.5".into());
        }
        if self.normal_streams == 0 || self.never_readers == 0 {
            return Err("--normal-streams and --never-readers must be at least 1".into());
        }
        if self.bulk_bytes < 4 * self.flow_window_bytes {
            return Err("--bulk-bytes must be at least 4 windows".into());
        }
        let stall = self.stall_timeout_ms.unwrap_or(3 * window_ms + 2_000);
        let exe_dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(IsolationOptions {
            quick,
            rounds,
            window_ms,
            normal_streams: self.normal_streams,
            normal_tokens: self.normal_tokens,
            inter_token_ms: self.inter_token_ms,
            never_readers: self.never_readers,
            bulk_bytes: self.bulk_bytes,
            flow_window_bytes: self.flow_window_bytes,
            client_write_stall_timeout_ms: stall,
            cores: (self.edge_cores.clone(), self.node_cores.clone()),
            bin_dir: self.bin_dir.clone().unwrap_or(exe_dir),
            bench_exe: exe.to_path_buf(),
            out_dir: self.out.clone(),
            keep_temp: self.keep_temp,
        })
    }
}

/// Runs `bench isolation`.
pub fn main(args: IsolationArgs) -> ExitCode {
    let report = crate::compare::run_command(
        "isolation",
        |exe| args.resolve(exe),
        |o: &IsolationOptions| o.out_dir.as_path(),
        run,
        render_table,
    );
    match report {
        Some(report) if !report.incomplete() => ExitCode::SUCCESS,
        _ => ExitCode::from(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> IsolationArgs {
        IsolationArgs {
            normal_streams: 10,
            never_readers: 10,
            normal_tokens: 64,
            inter_token_ms: 20,
            bulk_bytes: 16 * 1024 * 1024,
            flow_window_bytes: 256 * 1024,
            edge_cores: "0".into(),
            node_cores: "0".into(),
            out: "bench/results".into(),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_and_quick() {
        let o = base().resolve(Path::new("/t/release/bench")).unwrap();
        assert_eq!((o.rounds, o.window_ms), (3, 5_000));
        assert_eq!(o.client_write_stall_timeout_ms, 17_000);
        assert_eq!(o.bin_dir, PathBuf::from("/t/release"));
        let o = IsolationArgs {
            quick: true,
            ..base()
        }
        .resolve(Path::new("bench"))
        .unwrap();
        assert_eq!((o.rounds, o.window_ms), (1, 2_000));
        assert_eq!(o.client_write_stall_timeout_ms, 8_000);
    }

    #[test]
    fn bad_options_are_refused() {
        let refuse = |a: IsolationArgs| a.resolve(Path::new("bench")).unwrap_err();
        assert_eq!(
            refuse(IsolationArgs {
                rounds: Some(0),
                ..base()
            }),
            "--rounds must be at least 1"
        );
        assert_eq!(
            refuse(IsolationArgs {
                never_readers: 0,
                ..base()
            }),
            "--normal-streams and --never-readers must be at least 1"
        );
        assert_eq!(
            refuse(IsolationArgs {
                bulk_bytes: 1024,
                ..base()
            }),
            "--bulk-bytes must be at least 4 windows"
        );
    }
}
