//! `bench instructions`: arguments and defaults.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use argh::FromArgs;

use super::{render, run, InstructionsOptions};

/// Count the user-space instructions the relay (Edge + Node) runs per
/// relayed token, with callgrind, and a peer proxy's over the same load
/// (the peer's processes must already run under callgrind:
/// `scripts/bench.sh --peer-nginx` starts nginx so). Starts the mock,
/// edge-bin and node-bin itself; needs valgrind.
#[derive(FromArgs, Debug, Clone, PartialEq, Default)]
#[argh(subcommand, name = "instructions")]
pub struct InstructionsArgs {
    /// concurrent streams of a round (default 200)
    #[argh(option, default = "200")]
    pub streams: u64,
    /// tokens per stream (default 64)
    #[argh(option, default = "64")]
    pub tokens: u32,
    /// the mock's delay between tokens, ms (default 100: callgrind slows
    /// the processes some fifty times, and a saturated process batches
    /// more and looks cheaper)
    #[argh(option, default = "100")]
    pub inter_token_ms: u64,
    /// measured rounds after the warm-up round (default 2)
    #[argh(option, default = "2")]
    pub rounds: u32,
    /// edge-bin --cores (default: the first allowed CPU)
    #[argh(option)]
    pub edge_cores: Option<String>,
    /// node-bin --cores (default: the second allowed CPU, else the first)
    #[argh(option)]
    pub node_cores: Option<String>,
    /// directory holding edge-bin and node-bin (default: this executable's
    /// directory)
    #[argh(option)]
    pub bin_dir: Option<PathBuf>,
    /// port of the mock provider (default 0: any), so a peer proxy can be
    /// configured before the run
    #[argh(option, default = "0")]
    pub mock_port: u16,
    /// base URL of a peer proxy in front of the mock
    #[argh(option)]
    pub peer: Option<String>,
    /// a process of the peer, running under callgrind (repeatable)
    #[argh(option)]
    pub peer_pid: Vec<u32>,
    /// the peer's name in the table (default peer)
    #[argh(option)]
    pub peer_name: Option<String>,
    /// write the report as JSON to this file
    #[argh(option)]
    pub json: Option<PathBuf>,
    /// keep the temporary directory (configs, callgrind dumps, logs)
    #[argh(switch)]
    pub keep_temp: bool,
}

impl InstructionsArgs {
    /// Resolves defaults; `allowed_cpus` picks the default Edge and Node
    /// cores, `exe` is this binary.
    pub fn resolve(
        &self,
        allowed_cpus: &BTreeSet<usize>,
        exe: &Path,
    ) -> Result<InstructionsOptions, String> {
        if !(1..=4096).contains(&self.streams) {
            return Err("--streams must be in 1..=4096".into());
        }
        if !(1..=4096).contains(&self.tokens) {
            return Err("--tokens must be in 1..=4096".into());
        }
        if !(1..=10_000).contains(&self.inter_token_ms) {
            return Err("--inter-token-ms must be in 1..=10000".into());
        }
        if !(1..=100).contains(&self.rounds) {
            return Err("--rounds must be in 1..=100".into());
        }
        if self.peer.is_some() == self.peer_pid.is_empty() {
            return Err("--peer and --peer-pid go together".into());
        }
        let mut cpus = allowed_cpus.iter().copied();
        let first = cpus.next().unwrap_or(0);
        let second = cpus.next().unwrap_or(first);
        let exe_dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(InstructionsOptions {
            streams: self.streams,
            tokens: self.tokens,
            inter_token_ms: self.inter_token_ms,
            rounds: self.rounds,
            edge_cores: self.edge_cores.clone().unwrap_or_else(|| first.to_string()),
            node_cores: self
                .node_cores
                .clone()
                .unwrap_or_else(|| second.to_string()),
            bin_dir: self.bin_dir.clone().unwrap_or(exe_dir),
            bench_exe: exe.to_path_buf(),
            mock_port: self.mock_port,
            peer: self.peer.clone(),
            peer_pids: self.peer_pid.clone(),
            peer_name: self.peer_name.clone().unwrap_or_else(|| "peer".into()),
            valgrind: PathBuf::from("valgrind"),
            callgrind_control: PathBuf::from("callgrind_control"),
            json: self.json.clone(),
            keep_temp: self.keep_temp,
        })
    }
}

/// Runs `bench instructions`: exit 0 after a complete run, 1 when it could
/// not run.
pub fn main(args: InstructionsArgs) -> ExitCode {
    crate::compare::run_subcommand_exit(
        "instructions",
        |allowed, exe| args.resolve(allowed, exe),
        |options, stop| run(options, stop).map_err(|e| e.to_string()),
        render,
        |options| options.json.clone(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_refusals() {
        let cpus: BTreeSet<usize> = [0, 1].into_iter().collect();
        let base = InstructionsArgs {
            streams: 200,
            tokens: 64,
            inter_token_ms: 100,
            rounds: 2,
            ..Default::default()
        };
        let o = base.resolve(&cpus, Path::new("/t/release/bench")).unwrap();
        assert_eq!((o.edge_cores.as_str(), o.node_cores.as_str()), ("0", "1"));
        assert_eq!(o.bin_dir, PathBuf::from("/t/release"));
        assert_eq!(o.peer_name, "peer");
        let refuse = |a: InstructionsArgs| a.resolve(&cpus, Path::new("bench")).unwrap_err();
        assert_eq!(
            refuse(InstructionsArgs {
                peer: Some("http://127.0.0.1:1".into()),
                ..base.clone()
            }),
            "--peer and --peer-pid go together"
        );
        assert_eq!(
            refuse(InstructionsArgs { rounds: 0, ..base }),
            "--rounds must be in 1..=100"
        );
    }
}
