//! `bench cores`: arguments, defaults (standard and quick), the run, the
//! table on stdout and the JSON file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use argh::FromArgs;
use iop_engine::rt::CoreList;

use super::report::render_table;
use super::{run, CoresOptions};
use crate::load::cli::seconds_to_ms;

/// The layouts measured without `--layout`.
pub const DEFAULT_LAYOUTS: [&str; 2] = ["0", "0-1"];
/// Largest `--token-bytes` (the mock's own limit).
pub const MAX_TOKEN_BYTES: u32 = 512 * 1024;

/// Measure bulk relay throughput per core layout: for each `--layout`,
/// edge-bin and node-bin both get that `--cores`; closed-loop streams of
/// padded tokens run through each layout and directly to the mock, in
/// alternating rounds. Reports body bytes/s, requests/s and the ratios;
/// writes a JSON report. Exits 1 if any stream did not complete.
#[derive(FromArgs, Debug, Clone, PartialEq, Default)]
#[argh(subcommand, name = "cores")]
pub struct CoresArgs {
    /// short run: fewer rounds and shorter windows
    #[argh(switch)]
    pub quick: bool,
    /// a core layout (taskset syntax, e.g. `0-1`) given to both edge-bin
    /// and node-bin; repeat for more (default: 0 and 0-1)
    #[argh(option)]
    pub layout: Vec<String>,
    /// rounds, each one window per arm, order alternating (default 4;
    /// quick 2; at least 2)
    #[argh(option)]
    pub rounds: Option<u32>,
    /// seconds per window (default 8; quick 3)
    #[argh(option)]
    pub window_s: Option<f64>,
    /// unmeasured warm-up seconds per arm (default 2; quick 0.5)
    #[argh(option)]
    pub warmup_s: Option<f64>,
    /// concurrent closed-loop streams (default 32)
    #[argh(option, default = "32")]
    pub concurrency: u64,
    /// content tokens per stream (default 256)
    #[argh(option, default = "256")]
    pub tokens: u32,
    /// bytes of each content token (default 4096)
    #[argh(option, default = "4096")]
    pub token_bytes: u32,
    /// pin one load thread per listed core (default: one unpinned thread)
    #[argh(option)]
    pub load_cores: Option<String>,
    /// directory holding edge-bin and node-bin (default: this executable's
    /// directory)
    #[argh(option)]
    pub bin_dir: Option<PathBuf>,
    /// directory for the JSON report (default bench/results)
    #[argh(option, default = "PathBuf::from(\"bench/results\")")]
    pub out: PathBuf,
    /// model the mock serves (default mock-model)
    #[argh(option, default = "String::from(\"mock-model\")")]
    pub mock_model: String,
    /// model relayed requests name (default bench-model)
    #[argh(option, default = "String::from(\"bench-model\")")]
    pub edge_model: String,
    /// keep the temporary directory (configs, certificates, child logs)
    #[argh(switch)]
    pub keep_temp: bool,
}

impl CoresArgs {
    /// Resolves defaults and checks every layout against `allowed_cpus`;
    /// `exe` is this binary.
    pub fn resolve(
        &self,
        allowed_cpus: &BTreeSet<usize>,
        exe: &Path,
    ) -> Result<CoresOptions, String> {
        let quick = self.quick;
        let rounds = self.rounds.unwrap_or(if quick { 2 } else { 4 });
        if rounds < 2 {
            return Err("--rounds must be at least 2".into());
        }
        let window_ms = seconds_to_ms(
            self.window_s.unwrap_or(if quick { 3.0 } else { 8.0 }),
            "--window-s",
        )?;
        if window_ms < 100 {
            return Err("--window-s must be at least 0.1".into());
        }
        let warmup_ms = seconds_to_ms(
            self.warmup_s.unwrap_or(if quick { 0.5 } else { 2.0 }),
            "--warmup-s",
        )?;
        if self.concurrency == 0 {
            return Err("--concurrency must be at least 1".into());
        }
        if self.tokens == 0 {
            return Err("--tokens must be at least 1".into());
        }
        if self.token_bytes > MAX_TOKEN_BYTES {
            return Err(format!("--token-bytes must be at most {MAX_TOKEN_BYTES}"));
        }
        let layouts: Vec<String> = if self.layout.is_empty() {
            DEFAULT_LAYOUTS.iter().map(|l| l.to_string()).collect()
        } else {
            self.layout.iter().map(|l| l.trim().to_string()).collect()
        };
        for (i, layout) in layouts.iter().enumerate() {
            let cores = CoreList::parse(layout).map_err(|e| format!("--layout {layout}: {e}"))?;
            cores
                .check_allowed(allowed_cpus)
                .map_err(|e| format!("--layout {layout}: {e}"))?;
            if layouts[..i].contains(layout) {
                return Err(format!("--layout {layout} is given twice"));
            }
        }
        let exe_dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(CoresOptions {
            quick,
            layouts,
            rounds,
            window_ms,
            warmup_ms,
            concurrency: self.concurrency,
            tokens: self.tokens,
            token_bytes: self.token_bytes,
            load_cores: self.load_cores.clone(),
            bin_dir: self.bin_dir.clone().unwrap_or(exe_dir),
            bench_exe: exe.to_path_buf(),
            out_dir: self.out.clone(),
            mock_model: self.mock_model.clone(),
            edge_model: self.edge_model.clone(),
            keep_temp: self.keep_temp,
        })
    }
}

/// Runs `bench cores`.
pub fn main(args: CoresArgs) -> ExitCode {
    let allowed = iop_engine::rt::allowed_cpus().unwrap_or_else(|_| BTreeSet::from([0]));
    let report = crate::compare::run_command(
        "cores",
        |exe| args.resolve(&allowed, exe),
        |o: &CoresOptions| o.out_dir.as_path(),
        run,
        render_table,
    );
    match report {
        Some(report) if report.incomplete_requests > 0 => {
            eprintln!(
                "bench cores: {} requests did not complete (see INCOMPLETE above)",
                report.incomplete_requests
            );
            ExitCode::from(1)
        }
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

    fn base() -> CoresArgs {
        CoresArgs {
            concurrency: 32,
            tokens: 256,
            token_bytes: 4096,
            out: "bench/results".into(),
            mock_model: "mock-model".into(),
            edge_model: "bench-model".into(),
            ..Default::default()
        }
    }

    #[test]
    fn standard_and_quick_defaults() {
        let o = base()
            .resolve(&cpus(&[0, 1]), Path::new("/t/release/bench"))
            .unwrap();
        assert_eq!(o.layouts, vec!["0".to_string(), "0-1".to_string()]);
        assert_eq!(o.rounds, 4);
        assert_eq!(o.window_ms, 8_000);
        assert_eq!(o.warmup_ms, 2_000);
        assert_eq!((o.concurrency, o.tokens, o.token_bytes), (32, 256, 4096));
        assert_eq!(o.bin_dir, PathBuf::from("/t/release"));
        let o = CoresArgs {
            quick: true,
            ..base()
        }
        .resolve(&cpus(&[0, 1]), Path::new("bench"))
        .unwrap();
        assert_eq!((o.rounds, o.window_ms, o.warmup_ms), (2, 3_000, 500));
        let o = CoresArgs {
            layout: vec!["1".into(), " 0,1 ".into()],
            rounds: Some(3),
            ..base()
        }
        .resolve(&cpus(&[0, 1]), Path::new("bench"))
        .unwrap();
        assert_eq!(o.layouts, vec!["1".to_string(), "0,1".to_string()]);
        assert_eq!(o.rounds, 3);
    }

    #[test]
    fn bad_options_are_refused() {
        let refuse = |a: CoresArgs| a.resolve(&cpus(&[0, 1]), Path::new("bench")).unwrap_err();
        assert_eq!(
            refuse(CoresArgs {
                rounds: Some(1),
                ..base()
            }),
            "--rounds must be at least 2"
        );
        assert_eq!(
            refuse(CoresArgs {
                layout: vec!["0-3".into()],
                ..base()
            }),
            "--layout 0-3: core 2 is not in this process's allowed CPU set (0,1)"
        );
        assert_eq!(
            refuse(CoresArgs {
                layout: vec!["0".into(), "0".into()],
                ..base()
            }),
            "--layout 0 is given twice"
        );
        assert!(refuse(CoresArgs {
            layout: vec!["x".into()],
            ..base()
        })
        .starts_with("--layout x: "));
        assert_eq!(
            refuse(CoresArgs {
                concurrency: 0,
                ..base()
            }),
            "--concurrency must be at least 1"
        );
        assert_eq!(
            refuse(CoresArgs {
                token_bytes: MAX_TOKEN_BYTES + 1,
                ..base()
            }),
            "--token-bytes must be at most 524288"
        );
    }
}
