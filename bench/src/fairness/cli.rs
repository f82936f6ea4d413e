//! `bench fairness`: arguments, defaults (standard and quick), the run, the
//! markdown tables on stdout and the JSON file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use argh::FromArgs;

use super::report::render_table;
use super::{run, FairnessOptions};

/// Largest capacity of a model.
pub const MAX_CAPACITY: u32 = 64;

/// Measure how the Edge shares one saturated model between two keys: key
/// A floods open loop at 10× capacity, key B sends at a low rate, then at
/// capacity; with both keys one principal (FIFO), two principals of
/// weight 1:1 (weighted fair queueing) and B interactive against A batch
/// (priority), side by side. Prints B's queue wait p50/p99, each key's
/// share of the admissions per window while both are backlogged, and the
/// 1:1 goal (docs/bench-fairness.md). Starts the mock, edge-bin and
/// node-bin itself.
#[derive(FromArgs, Debug, Clone, PartialEq, Default)]
#[argh(subcommand, name = "fairness")]
pub struct FairnessArgs {
    /// short run: latency phases of 6 s, share phases of 14 s (about a
    /// minute and a half in all)
    #[argh(switch)]
    pub quick: bool,
    /// concurrent requests of each model's provider (default 4)
    #[argh(option, default = "4")]
    pub capacity: u32,
    /// rate of key A (the flood) as a multiple of the capacity (default 10)
    #[argh(option, default = "10.0")]
    pub flood_factor: f64,
    /// rate of key B in the latency phase as a multiple of the capacity
    /// (default 0.1)
    #[argh(option, default = "0.1")]
    pub latency_b_factor: f64,
    /// seconds of each latency phase (default 20; quick 6)
    #[argh(option)]
    pub latency_s: Option<u64>,
    /// seconds of each share phase (default 32; quick 14)
    #[argh(option)]
    pub share_s: Option<u64>,
    /// seconds of a share window (default 4)
    #[argh(option, default = "4")]
    pub window_s: u64,
    /// edge-bin --cores (default: the first allowed CPU)
    #[argh(option)]
    pub edge_cores: Option<String>,
    /// node-bin --cores (default: the second allowed CPU, else the first)
    #[argh(option)]
    pub node_cores: Option<String>,
    /// write the report as JSON to this file
    #[argh(option)]
    pub json: Option<PathBuf>,
    /// directory holding edge-bin and node-bin (default: this executable's
    /// directory)
    #[argh(option)]
    pub bin_dir: Option<PathBuf>,
    /// keep the temporary directory (configs, certificates, access log,
    /// child logs)
    #[argh(switch)]
    pub keep_temp: bool,
}

impl FairnessArgs {
    /// Resolves defaults; `allowed_cpus` picks the default Edge and Node
    /// cores, `exe` is this binary.
    pub fn resolve(
        &self,
        allowed_cpus: &BTreeSet<usize>,
        exe: &Path,
    ) -> Result<FairnessOptions, String> {
        let quick = self.quick;
        if !(1..=MAX_CAPACITY).contains(&self.capacity) {
            return Err(format!("--capacity must be in 1..={MAX_CAPACITY}"));
        }
        if !(1.0..=50.0).contains(&self.flood_factor) {
            return Err("--flood-factor must be in 1..=50".into());
        }
        if !(0.01..=1.0).contains(&self.latency_b_factor) {
            return Err("--latency-b-factor must be in 0.01..=1".into());
        }
        let latency_s = self.latency_s.unwrap_or(if quick { 6 } else { 20 });
        let share_s = self.share_s.unwrap_or(if quick { 14 } else { 32 });
        if !(1..=600).contains(&latency_s) || !(1..=600).contains(&share_s) {
            return Err("--latency-s and --share-s must be in 1..=600".into());
        }
        if self.window_s == 0 || self.window_s > share_s {
            return Err("--window-s must be at least 1 and at most --share-s".into());
        }
        let mut cpus = allowed_cpus.iter().copied();
        let first = cpus.next().unwrap_or(0);
        let second = cpus.next().unwrap_or(first);
        let exe_dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(FairnessOptions {
            quick,
            capacity: self.capacity,
            ttft_ms: 50,
            tokens: 8,
            inter_token_ms: 50,
            flood_factor: self.flood_factor,
            latency_b_factor: self.latency_b_factor,
            share_b_factor: 1.5,
            latency_ms: latency_s * 1000,
            share_ms: share_s * 1000,
            window_ms: self.window_s * 1000,
            edge_cores: self.edge_cores.clone().unwrap_or_else(|| first.to_string()),
            node_cores: self
                .node_cores
                .clone()
                .unwrap_or_else(|| second.to_string()),
            bin_dir: self.bin_dir.clone().unwrap_or(exe_dir),
            bench_exe: exe.to_path_buf(),
            json: self.json.clone(),
            keep_temp: self.keep_temp,
        })
    }
}

/// Runs `bench fairness`: exit 0 after a complete run, 1 when it could not
/// run.
pub fn main(args: FairnessArgs) -> ExitCode {
    crate::compare::run_subcommand_exit(
        "fairness",
        |allowed, exe| args.resolve(allowed, exe),
        |options, stop| run(options, stop).map_err(|e| e.to_string()),
        render_table,
        |options| options.json.clone(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpus(list: &[usize]) -> BTreeSet<usize> {
        list.iter().copied().collect()
    }

    fn base() -> FairnessArgs {
        FairnessArgs {
            capacity: 4,
            flood_factor: 10.0,
            latency_b_factor: 0.1,
            window_s: 4,
            ..Default::default()
        }
    }

    #[test]
    fn standard_and_quick_defaults() {
        let o = base()
            .resolve(&cpus(&[0, 1]), Path::new("/t/debug/bench"))
            .unwrap();
        assert_eq!(
            (o.latency_ms, o.share_ms, o.window_ms),
            (20_000, 32_000, 4000)
        );
        // 50 ms TTFT + 7 gaps of 50 ms: 400 ms a request, 4 at once: 10/s.
        assert_eq!(o.service_ms(), 400);
        assert_eq!(o.capacity_per_s(), 10.0);
        assert_eq!((o.edge_cores.as_str(), o.node_cores.as_str()), ("0", "1"));
        assert_eq!(o.bin_dir, PathBuf::from("/t/debug"));
        let o = FairnessArgs {
            quick: true,
            capacity: 2,
            ..base()
        }
        .resolve(&cpus(&[3]), Path::new("bench"))
        .unwrap();
        assert_eq!((o.latency_ms, o.share_ms), (6000, 14_000));
        assert_eq!(o.capacity_per_s(), 5.0);
        assert_eq!((o.edge_cores.as_str(), o.node_cores.as_str()), ("3", "3"));
    }

    #[test]
    fn bad_options_are_refused() {
        let refuse = |a: FairnessArgs| a.resolve(&cpus(&[0]), Path::new("bench")).unwrap_err();
        assert_eq!(
            refuse(FairnessArgs {
                capacity: 0,
                ..base()
            }),
            "--capacity must be in 1..=64"
        );
        assert_eq!(
            refuse(FairnessArgs {
                flood_factor: 0.5,
                ..base()
            }),
            "--flood-factor must be in 1..=50"
        );
        assert_eq!(
            refuse(FairnessArgs {
                window_s: 40,
                ..base()
            }),
            "--window-s must be at least 1 and at most --share-s"
        );
        assert_eq!(
            refuse(FairnessArgs {
                latency_s: Some(0),
                ..base()
            }),
            "--latency-s and --share-s must be in 1..=600"
        );
    }
}
