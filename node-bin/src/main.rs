//! `node-bin` entry point: arguments, configuration, runtime. See the
//! library crate (`node_bin`) for the daemon itself.
//!
//! Runtime layout from `--cores`: the first core is the control shard (this
//! thread, pinned: supervisor, Edge session, run manager, watchdog wheel,
//! signals, the SIGUSR1 dumper); every further core gets a pinned provider
//! worker thread with its own monoio runtime and keep-alive pool
//! (`node_bin::workers`). One core runs everything on this thread. Worker
//! threads end with the process when the control shard returns.
//!
//! Subcommand: `keys recipient --out PATH` writes a new X25519 recipient key
//! (mode 0600) and prints its public `x25519:` form for the Edge's node entry
//! (`recipient_key`).
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use argh::FromArgs;
use iop_engine::rt::{self, CoreList, Signal, SignalPipe};
use iop_engine::tls::{NodeTlsConnector, TlsFiles, TlsMaterial};

use node_bin::calls::workers;
use node_bin::config::NodeConfig;
use node_bin::credentials::NodeCredentials;
use node_bin::supervisor::{self, Exit};

/// IOP Node: dials the Edge and serves its requests against local
/// inference servers.
#[derive(FromArgs, Debug)]
struct Args {
    /// path to node.toml (required unless a subcommand is given)
    #[argh(option)]
    config: Option<String>,
    /// CPU cores to run on, taskset syntax (`0-3`, `0,2,5-7`, `0-31:2`).
    /// The first is the control shard (Edge session, run manager,
    /// watchdog); every other core is a provider worker with its own
    /// keep-alive pool. One core runs everything on that thread. Default: 0.
    #[argh(option, default = "String::from(\"0\")")]
    cores: String,
    #[argh(subcommand)]
    command: Option<Command>,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
enum Command {
    Keys(KeysArgs),
}

/// Credential-plane keys of this Node.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "keys")]
struct KeysArgs {
    #[argh(subcommand)]
    command: KeysCommand,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
enum KeysCommand {
    Recipient(RecipientArgs),
}

/// Generate this Node's X25519 recipient key (mode 0600, never overwritten)
/// and print its public key for the Edge's `[[nodes]] recipient_key`.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "recipient")]
struct RecipientArgs {
    /// the private key file to create
    #[argh(option)]
    out: PathBuf,
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("node-bin: error: {message}");
    ExitCode::from(1)
}

fn main() -> ExitCode {
    let args: Args = argh::from_env();
    iop_engine::rt::init_logging();
    match args.command {
        Some(Command::Keys(KeysArgs {
            command: KeysCommand::Recipient(a),
        })) => match iop_engine::keys::generate_recipient_key(&a.out) {
            Ok(public) => {
                println!("{}", iop_engine::keys::encode_recipient_public_key(&public));
                ExitCode::SUCCESS
            }
            Err(e) => fail(format_args!("keys recipient: {e}")),
        },
        None => match &args.config {
            Some(path) => serve(path, &args.cores),
            None => fail("--config is required (or a subcommand: keys)"),
        },
    }
}

/// On every SIGHUP: re-reads the `[tls]` files and, when they load and name
/// this node, swaps them into `connector` for every later dial. A bad file
/// keeps the running identity and says why.
fn spawn_certificate_reloader(
    mut hup: SignalPipe,
    files: Option<iop_engine::config::TlsFiles>,
    connector: Option<NodeTlsConnector>,
    source: std::path::PathBuf,
) {
    monoio::spawn(async move {
        while hup.recv().await.is_ok() {
            let (Some(files), Some(connector)) = (&files, &connector) else {
                tracing::info!("SIGHUP: no [tls] to reload (insecure_plaintext)");
                continue;
            };
            let outcome = TlsMaterial::from_files(&TlsFiles::from(files))
                .and_then(|material| connector.reload(&material));
            match outcome {
                Ok(id) => tracing::info!(
                    identity = %id.id.uri(),
                    cert_serial = %id.serial_hex,
                    not_after_unix_s = id.not_after_unix_s,
                    "node certificate reloaded: the next Edge connection presents it"
                ),
                Err(e) => tracing::error!(
                    error = %format_args!("{}: tls: {e}", source.display()),
                    "node certificate not reloaded; keeping the running one"
                ),
            }
        }
    });
}

fn serve(config_path: &str, cores_arg: &str) -> ExitCode {
    // Before any runtime thread allocates: large buffers go back to the OS
    // when freed (see iop_engine::memory).
    iop_engine::memory::return_freed_memory();
    // S3: every local configuration or credential problem exits 1.
    let cfg = match NodeConfig::load(config_path) {
        Ok(cfg) => cfg,
        Err(e) => return fail(e),
    };
    // C2: the recipient key is read once, here (0600 checked).
    let credentials = match NodeCredentials::load(&cfg) {
        Ok(credentials) => credentials,
        Err(e) => return fail(e),
    };
    if let Some(credentials) = &credentials {
        tracing::info!(
            recipient_key_id = %credentials.recipient_key_id(),
            "credential plane enabled: tunnels must carry a credential lease"
        );
    }
    let cores = match CoreList::parse_for_this_process(cores_arg) {
        Ok(c) => c,
        Err(e) => return fail(format_args!("--cores {cores_arg}: {e}")),
    };
    let connector = match &cfg.tls {
        Some(files) => {
            let material = match TlsMaterial::from_files(&TlsFiles::from(files)) {
                Ok(m) => m,
                Err(e) => return fail(format_args!("{}: tls: {e}", cfg.source.display())),
            };
            match NodeTlsConnector::new(&material, &cfg.trust_domain, &cfg.edge_name) {
                Ok(c) => {
                    // T3: we register under the name our certificate proves.
                    if c.local_identity().name() != cfg.node_id {
                        return fail(format_args!(
                            "{}: node_id: `{}` does not match the certificate identity {}",
                            cfg.source.display(),
                            cfg.node_id,
                            c.local_identity().uri()
                        ));
                    }
                    let own = c.local_certificate();
                    tracing::info!(
                        identity = %own.id.uri(),
                        cert_serial = %own.serial_hex,
                        not_after_unix_s = own.not_after_unix_s,
                        "node certificate loaded (SIGHUP reloads it)"
                    );
                    Some(c)
                }
                Err(e) => return fail(format_args!("{}: tls: {e}", cfg.source.display())),
            }
        }
        None => {
            tracing::warn!("insecure_plaintext: dialling the edge without TLS (dev only, T5)");
            None
        }
    };
    // Worker cores first: each pins its thread and builds its runtime, and
    // a failure is a local error (exit 1) before anything dials.
    let worker_cores = &cores.cores()[1..];
    let workers = if worker_cores.is_empty() {
        None
    } else {
        let (workers, inboxes) = workers::channels(worker_cores.len());
        for (&core, inbox) in worker_cores.iter().zip(inboxes) {
            // The threads end with the process (their loops also end once
            // the control shard's handles are gone).
            if let Err(e) = workers::spawn_thread(inbox, Some(core)) {
                return fail(format_args!("provider worker on core {core}: {e}"));
            }
        }
        Some(workers)
    };
    if let Err(e) = rt::pin_current_thread(cores.control()) {
        return fail(format_args!("pin to core {}: {e}", cores.control()));
    }
    let worker_list: Vec<String> = worker_cores.iter().map(|c| c.to_string()).collect();
    tracing::info!(
        node_id = %cfg.node_id,
        edge = %cfg.edge_addr,
        driver = %rt::detect_driver(),
        cores = %cores,
        control_core = cores.control(),
        worker_cores = %if worker_list.is_empty() {
            "none (provider calls on the control core)".to_string()
        } else {
            worker_list.join(",")
        },
        "node-bin starting"
    );
    let result = rt::block_on(async move {
        // SIGTERM/SIGINT drain (a second one stops at once); systemd hears
        // READY=1 after the first ready session and STOPPING=1 at the first
        // signal.
        let (shutdown, force) = supervisor::signal_stops()?;
        // SIGUSR1 dumps the latency histograms to stderr.
        iop_engine::metrics::spawn_usr1_dumper(iop_engine::metrics::Side::Node)?;
        // SIGHUP reloads our certificate, key and CA bundle for the next
        // dial (the open Edge connection keeps its own).
        let hup = SignalPipe::install(Signal::Hup)?;
        spawn_certificate_reloader(hup, cfg.tls.clone(), connector.clone(), cfg.source.clone());
        let stop = supervisor::Stop {
            shutdown,
            force,
            drain_grace: Duration::from_millis(cfg.drain_grace_ms),
        };
        Ok::<Exit, std::io::Error>(
            supervisor::run_sharded(cfg, connector, credentials, stop, workers).await,
        )
    });
    match result {
        Ok(Ok(Exit::Shutdown)) => {
            tracing::info!("shutting down");
            ExitCode::SUCCESS
        }
        Ok(Ok(Exit::GaveUp | Exit::LocalError)) => ExitCode::from(1),
        Ok(Err(e)) | Err(e) => fail(format_args!("runtime: {e}")),
    }
}
