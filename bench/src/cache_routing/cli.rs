//! `bench cache-routing`: arguments, defaults (standard and quick), the
//! run, the markdown table on stdout and the JSON file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use argh::FromArgs;

use super::report::render_table;
use super::{run, CacheRoutingOptions};

/// The pool sizes measured without `--providers`.
pub const DEFAULT_PROVIDERS: [u32; 2] = [2, 4];
/// Largest pool size.
pub const MAX_PROVIDERS: u32 = 16;
/// Largest provider capacity.
pub const MAX_CAPACITY: u32 = 64;

/// Measure the Edge's per-model routing policies (least_loaded, session,
/// prefix, and pinned models as the yardstick) against mock providers that
/// model a prefix cache: multi-turn conversations, a shared system prompt,
/// and prompts with nothing in common; per pool size, TTFT p50/p99, cache
/// hit rate, requests/s and the goal ratios (docs/bench-cache-routing.md).
/// Starts the mocks, edge-bin and node-bin itself. Exits 1 if any request
/// failed (after printing the table).
#[derive(FromArgs, Debug, Clone, PartialEq, Default)]
#[argh(subcommand, name = "cache-routing")]
pub struct CacheRoutingArgs {
    /// short run: 2 rounds, 4 turns, fewer requests (under a minute)
    #[argh(switch)]
    pub quick: bool,
    /// pool sizes, comma-separated: the whole measurement runs for each
    /// (default 2,4)
    #[argh(option)]
    pub providers: Option<String>,
    /// concurrent requests per provider at the Edge (default 2)
    #[argh(option, default = "2")]
    pub capacity: u32,
    /// rounds per workload, each one window per policy, the order reversed
    /// every other round (default 4; quick 2; even)
    #[argh(option)]
    pub rounds: Option<u32>,
    /// turns per conversation (default 6; quick 4; at least 2)
    #[argh(option)]
    pub turns: Option<u32>,
    /// conversations per provider: C = this × P (default 3)
    #[argh(option, default = "3")]
    pub conversations_per_provider: u32,
    /// conversations each mock's prefix cache holds at their longest
    /// (default: conversations per provider + 1)
    #[argh(option)]
    pub cache_conversations: Option<u32>,
    /// the mocks' prefill time per uncached prompt word, µs (default 50)
    #[argh(option, default = "50")]
    pub prefill_us_per_token: u64,
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
    /// keep the temporary directory (configs, certificates, child logs)
    #[argh(switch)]
    pub keep_temp: bool,
}

/// Parses `2,4`: distinct pool sizes of 1 to [`MAX_PROVIDERS`].
fn parse_providers(text: &str) -> Result<Vec<u32>, String> {
    let mut sizes = Vec::new();
    for part in text.split(',').map(str::trim) {
        let size: u32 = part
            .parse()
            .map_err(|_| format!("--providers: `{part}` is not a number"))?;
        if !(1..=MAX_PROVIDERS).contains(&size) {
            return Err(format!("--providers: {size} is not in 1..={MAX_PROVIDERS}"));
        }
        if sizes.contains(&size) {
            return Err(format!("--providers: {size} is given twice"));
        }
        sizes.push(size);
    }
    Ok(sizes)
}

impl CacheRoutingArgs {
    /// Resolves defaults; `allowed_cpus` picks the default Edge and Node
    /// cores, `exe` is this binary.
    pub fn resolve(
        &self,
        allowed_cpus: &BTreeSet<usize>,
        exe: &Path,
    ) -> Result<CacheRoutingOptions, String> {
        let quick = self.quick;
        let providers = match &self.providers {
            Some(text) => parse_providers(text)?,
            None => DEFAULT_PROVIDERS.to_vec(),
        };
        if !(1..=MAX_CAPACITY).contains(&self.capacity) {
            return Err(format!("--capacity must be in 1..={MAX_CAPACITY}"));
        }
        let rounds = self.rounds.unwrap_or(if quick { 2 } else { 4 });
        if rounds == 0 || rounds % 2 == 1 {
            return Err("--rounds must be even and at least 2".into());
        }
        let turns = self.turns.unwrap_or(if quick { 4 } else { 6 });
        if !(2..=100).contains(&turns) {
            return Err("--turns must be in 2..=100".into());
        }
        if !(1..=100).contains(&self.conversations_per_provider) {
            return Err("--conversations-per-provider must be in 1..=100".into());
        }
        let cache_conversations = self
            .cache_conversations
            .unwrap_or(self.conversations_per_provider + 1);
        if cache_conversations > 1000 {
            return Err("--cache-conversations must be at most 1000".into());
        }
        if self.prefill_us_per_token > 100_000 {
            return Err("--prefill-us-per-token must be at most 100000".into());
        }
        let mut cpus = allowed_cpus.iter().copied();
        let first = cpus.next().unwrap_or(0);
        let second = cpus.next().unwrap_or(first);
        let exe_dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(CacheRoutingOptions {
            quick,
            providers,
            capacity: self.capacity,
            rounds,
            conversations_per_provider: self.conversations_per_provider,
            turns,
            system_words: 400,
            user_words: 40,
            think_ms_max: 60,
            cache_conversations,
            reply_tokens: 16,
            ttft_ms: 2,
            inter_token_ms: 1,
            prefill_us_per_token: self.prefill_us_per_token,
            shared_prompts_per_provider: 2,
            shared_prompt_words: 600,
            question_words: 12,
            shared_requests_per_provider: if quick { 12 } else { 40 },
            unique_prompt_words: 300,
            unique_requests_per_provider: if quick { 24 } else { 80 },
            unique_concurrency_per_slot: 2,
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

/// Runs `bench cache-routing`: exit 0 after a complete run, 1 when it could
/// not run or a request failed.
pub fn main(args: CacheRoutingArgs) -> ExitCode {
    let report = match crate::compare::run_subcommand(
        "cache-routing",
        |allowed, exe| args.resolve(allowed, exe),
        |options, stop| run(options, stop).map_err(|e| e.to_string()),
        render_table,
        |options| options.json.clone(),
    ) {
        Ok(report) => report,
        Err(code) => return code,
    };
    if report.failed_requests > 0 {
        eprintln!(
            "bench cache-routing: {} requests failed",
            report.failed_requests
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpus(list: &[usize]) -> BTreeSet<usize> {
        list.iter().copied().collect()
    }

    fn base() -> CacheRoutingArgs {
        CacheRoutingArgs {
            capacity: 2,
            conversations_per_provider: 3,
            prefill_us_per_token: 50,
            ..Default::default()
        }
    }

    #[test]
    fn standard_and_quick_defaults() {
        let o = base()
            .resolve(&cpus(&[0, 1]), Path::new("/t/debug/bench"))
            .unwrap();
        assert_eq!(o.providers, [2, 4]);
        assert_eq!((o.rounds, o.turns, o.capacity), (4, 6, 2));
        assert_eq!(o.cache_conversations, 4);
        // 400 system + 6 × 40 user + 5 × 16 reply words.
        assert_eq!(o.conversation_tokens_max(), 720);
        assert_eq!(o.cache_tokens(), 2880);
        assert_eq!((o.edge_cores.as_str(), o.node_cores.as_str()), ("0", "1"));
        assert_eq!(o.bin_dir, PathBuf::from("/t/debug"));
        assert_eq!(o.json, None);
        let o = CacheRoutingArgs {
            quick: true,
            providers: Some(" 4, 2".into()),
            json: Some("r.json".into()),
            ..base()
        }
        .resolve(&cpus(&[3]), Path::new("bench"))
        .unwrap();
        assert_eq!(o.providers, [4, 2]);
        assert_eq!((o.rounds, o.turns), (2, 4));
        assert_eq!(
            (
                o.shared_requests_per_provider,
                o.unique_requests_per_provider
            ),
            (12, 24)
        );
        assert_eq!((o.edge_cores.as_str(), o.node_cores.as_str()), ("3", "3"));
        assert_eq!(o.json, Some(PathBuf::from("r.json")));
    }

    #[test]
    fn bad_options_are_refused() {
        let refuse = |a: CacheRoutingArgs| a.resolve(&cpus(&[0]), Path::new("bench")).unwrap_err();
        assert_eq!(
            refuse(CacheRoutingArgs {
                rounds: Some(3),
                ..base()
            }),
            "--rounds must be even and at least 2"
        );
        assert_eq!(
            refuse(CacheRoutingArgs {
                providers: Some("2,x".into()),
                ..base()
            }),
            "--providers: `x` is not a number"
        );
        assert_eq!(
            refuse(CacheRoutingArgs {
                providers: Some("2,2".into()),
                ..base()
            }),
            "--providers: 2 is given twice"
        );
        assert_eq!(
            refuse(CacheRoutingArgs {
                providers: Some("0".into()),
                ..base()
            }),
            "--providers: 0 is not in 1..=16"
        );
        assert_eq!(
            refuse(CacheRoutingArgs {
                capacity: 0,
                ..base()
            }),
            "--capacity must be in 1..=64"
        );
        assert_eq!(
            refuse(CacheRoutingArgs {
                turns: Some(1),
                ..base()
            }),
            "--turns must be in 2..=100"
        );
    }
}
