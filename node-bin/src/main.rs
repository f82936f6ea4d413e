//! `node-bin` entry point: arguments, configuration, runtime. See the
//! library crate (`node_bin`) for the daemon itself.
//!
//! Runtime layout from `--cores`: the first core is the control shard (this
//! thread, pinned: supervisor, Edge session, run manager, watchdog wheel,
//! signals, the SIGUSR1 dumper); every further core gets a pinned provider
//! worker thread with its own monoio runtime and keep-alive pool
//! (`node_bin::calls::workers`). One core runs everything on this thread. Worker
//! threads end with the process when the control shard returns.
//!
//! Subcommands: `check-config FILE` (loads and validates a configuration the
//! way startup does, without dialling) and `keys recipient --out PATH`
//! (writes a new X25519 recipient key as PKCS#8 PEM, mode 0600, and prints
//! its public `x25519:` form for the Edge's node entry, `recipient_key`).
//! `--version` prints the version, commit and whether io_uring is
//! available; `--log-format json` writes JSON log lines.
//!
//! systemd (`NOTIFY_SOCKET`): `READY=1` once the configuration is loaded
//! and the supervisor dials (the Edge may be down: the Node keeps
//! redialling), `RELOADING=1` then `READY=1` around each SIGHUP,
//! `STOPPING=1` at the first stop signal.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use argh::FromArgs;
use iop_engine::build::{version_line, IoUring};
use iop_engine::rt::{self, notify, CoreList, LogFormat, Signal, SignalPipe};
use iop_engine::tls::{TlsFiles, TlsMaterial};

use node_bin::calls::workers;
use node_bin::config::NodeConfig;
use node_bin::credentials::NodeCredentials;
use node_bin::edges::EdgeTls;
use node_bin::supervisor::{self, Exit};

/// IOP Node: dials the Edge and serves its requests against local
/// inference servers.
#[derive(FromArgs, Debug)]
#[argh(
    example = "{command_name} --config /etc/iop/node.toml --cores 0-7\n\
               {command_name} check-config /etc/iop/node.toml\n\
               {command_name} keys recipient --out /etc/iop/keys/node-a.key",
    note = "Environment:\n\
            \u{00A0} RUST_LOG          log filter, default info (e.g. info,node_bin=debug)\n\
            \u{00A0} MONOIO_FORCE_LEGACY_DRIVER=1\n\
            \u{00A0}                   use epoll instead of io_uring\n\
            \u{00A0} NOTIFY_SOCKET     set by systemd (Type=notify-reload): READY=1 once\n\
            \u{00A0}                   the configuration is loaded and the Node dials\n\
            \u{00A0}                   (the Edge may still be down), RELOADING=1 then\n\
            \u{00A0}                   READY=1 around a reload, STOPPING=1 at the first\n\
            \u{00A0}                   stop signal\n\
            \n\
            Signals:\n\
            \u{00A0} SIGHUP            reload the [tls] certificate, key and CA bundle\n\
            \u{00A0}                   for the next dial (the open connection keeps its\n\
            \u{00A0}                   own); a bad file keeps the running identity\n\
            \u{00A0} SIGTERM, SIGINT   drain: tell the Edge (NodeDraining), which sends\n\
            \u{00A0}                   no new runs and sends new requests elsewhere;\n\
            \u{00A0}                   let runs finish for at most drain_grace_ms,\n\
            \u{00A0}                   exit 0; a second signal stops at once. An Edge\n\
            \u{00A0}                   of an earlier release is not told and may send\n\
            \u{00A0}                   new runs until the connection closes\n\
            \u{00A0} SIGUSR1           dump the latency histograms to stderr\n\
            \n\
            Several Edges (node.toml, examples/node.toml documents every key):\n\
            \u{00A0} edge_addr         \"host:port\" or a list of them; each dial resolves\n\
            \u{00A0}                   them all and tries the addresses in a fresh random\n\
            \u{00A0}                   order until one Edge registers the Node\n\
            \u{00A0} edge_name         the accepted Edge identity name, or a list of them\n\
            \u{00A0} [credentials] issuer_public_keys\n\
            \u{00A0}                   the lease issuer keys of every Edge (with or instead\n\
            \u{00A0}                   of issuer_public_key)\n\
            \n\
            Docs: README.md, docs/deployment.md (systemd units, ports, TLS, keys,\n\
            upgrades) and examples/node.toml."
)]
struct Args {
    /// path to node.toml (required unless a subcommand is given)
    #[argh(option)]
    config: Option<String>,
    /// print the version, the commit and whether io_uring is available, and
    /// exit
    #[argh(switch)]
    version: bool,
    /// log line format on stderr: text (default) or json (one object per
    /// line)
    #[argh(option, default = "LogFormat::Text", from_str_fn(log_format))]
    log_format: LogFormat,
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
    CheckConfig(CheckConfigArgs),
    Keys(KeysArgs),
}

/// Load and validate a configuration as startup does (every key, the TLS
/// certificate, key and CA, the recipient key) without dialling; exit 0 if
/// it would start, 1 with the file, key and reason if not.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "check-config")]
struct CheckConfigArgs {
    /// the node.toml to check
    #[argh(positional)]
    file: String,
}

fn log_format(text: &str) -> Result<LogFormat, String> {
    text.parse()
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

/// Generate this Node's X25519 recipient key as PKCS#8 PEM (mode 0600, never
/// overwritten; `openssl genpkey -algorithm x25519` makes an equivalent one)
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
    if args.version {
        println!("{}", version_line("node-bin", IoUring::probe()));
        return ExitCode::SUCCESS;
    }
    iop_engine::rt::init_logging_as(args.log_format);
    match args.command {
        Some(Command::CheckConfig(c)) => check_config(&c.file),
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
            None => fail("--config is required (or a subcommand: check-config, keys)"),
        },
    }
}

/// What startup loads from the configuration before it dials.
struct Loaded {
    cfg: NodeConfig,
    credentials: Option<NodeCredentials>,
    connector: Option<EdgeTls>,
}

/// `check-config FILE`: [`load`] and report; nothing dials.
fn check_config(path: &str) -> ExitCode {
    match load(path) {
        Ok(Loaded {
            cfg,
            credentials,
            connector,
        }) => {
            let on = |on: bool| if on { "on" } else { "off" };
            println!("{path}: ok");
            println!(
                "node {}: edge {} ({}), TLS {}, credential plane {}",
                cfg.node_id,
                cfg.edge_addr,
                cfg.edge_name,
                on(connector.is_some()),
                on(credentials.is_some()),
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

/// Reads and validates everything startup needs from the configuration
/// file: the file itself, the recipient key (0600 checked) and the TLS
/// identity (matching `node_id`). Dials nothing; the error names the file,
/// key and reason.
fn load(path: &str) -> Result<Loaded, String> {
    // S3: every local configuration or credential problem exits 1.
    let cfg = NodeConfig::load(path).map_err(|e| e.to_string())?;
    // C2: the recipient key is read once, here (0600 checked).
    let credentials = NodeCredentials::load(&cfg).map_err(|e| e.to_string())?;
    if let Some(credentials) = &credentials {
        tracing::info!(
            recipient_key_id = %credentials.recipient_key_id(),
            "credential plane enabled: tunnels must carry a credential lease"
        );
    }
    let source = cfg.source.display();
    let connector = match &cfg.tls {
        Some(files) => {
            let material = TlsMaterial::from_files(&TlsFiles::from(files))
                .map_err(|e| format!("{source}: tls: {e}"))?;
            let c = EdgeTls::new(&material, &cfg.trust_domain, &cfg.edge_name)
                .map_err(|e| format!("{source}: tls: {e}"))?;
            // T3: we register under the name our certificate proves.
            if c.local_identity().name() != cfg.node_id {
                return Err(format!(
                    "{source}: node_id: `{}` does not match the certificate identity {}",
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
        None => {
            tracing::warn!("insecure_plaintext: dialling the edge without TLS (dev only, T5)");
            None
        }
    };
    Ok(Loaded {
        cfg,
        credentials,
        connector,
    })
}

/// On every SIGHUP: re-reads the `[tls]` files and, when they load and name
/// this node, swaps them into `connector` for every later dial. A bad file
/// keeps the running identity and says why. systemd hears `RELOADING=1`
/// before and `READY=1` after (`Type=notify-reload`).
fn spawn_certificate_reloader(
    mut hup: SignalPipe,
    files: Option<iop_engine::config::TlsFiles>,
    connector: Option<EdgeTls>,
    source: std::path::PathBuf,
) {
    monoio::spawn(async move {
        while hup.recv().await.is_ok() {
            notify::notify(notify::State::reloading_now());
            reload_certificate(files.as_ref(), connector.as_ref(), &source);
            notify::notify(notify::State::Ready);
        }
    });
}

fn reload_certificate(
    files: Option<&iop_engine::config::TlsFiles>,
    connector: Option<&EdgeTls>,
    source: &std::path::Path,
) {
    let (Some(files), Some(connector)) = (files, connector) else {
        tracing::info!("SIGHUP: no [tls] to reload (insecure_plaintext)");
        return;
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

fn serve(config_path: &str, cores_arg: &str) -> ExitCode {
    // Before any runtime thread allocates: large buffers go back to the OS
    // when freed (see iop_engine::memory).
    iop_engine::memory::return_freed_memory();
    let Loaded {
        cfg,
        credentials,
        connector,
    } = match load(config_path) {
        Ok(loaded) => loaded,
        Err(e) => return fail(e),
    };
    let cores = match CoreList::parse_for_this_process(cores_arg) {
        Ok(c) => c,
        Err(e) => return fail(format_args!("--cores {cores_arg}: {e}")),
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
        edge_name = %cfg.edge_name,
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
        // STOPPING=1 at the first signal.
        let (shutdown, force) = supervisor::signal_stops()?;
        // SIGUSR1 dumps the latency histograms to stderr.
        iop_engine::metrics::spawn_usr1_dumper(iop_engine::metrics::Side::Node)?;
        // The session and tunnels run here (and provider calls without
        // workers): their histograms are allocated now, not by a request.
        iop_engine::metrics::prepare(iop_engine::metrics::Latency::of_side(
            iop_engine::metrics::Side::Node,
        ));
        // SIGHUP reloads our certificate, key and CA bundle for the next
        // dial (the open Edge connection keeps its own).
        let hup = SignalPipe::install(Signal::Hup)?;
        spawn_certificate_reloader(hup, cfg.tls.clone(), connector.clone(), cfg.source.clone());
        let stop = supervisor::Stop {
            shutdown,
            force,
            drain_grace: Duration::from_millis(cfg.drain_grace_ms),
        };
        // READY=1 now: the configuration, keys and certificate are loaded,
        // the signals installed, and the supervisor dials next. The Edge may
        // be down; the Node keeps redialling, so "ready" is not "connected"
        // (systemctl start does not block on the Edge; docs/deployment.md).
        notify::notify(notify::State::Ready);
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
