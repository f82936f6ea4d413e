//! `edge-bin` entry point: arguments, configuration, listeners. See the
//! library crate (`edge_bin`) for the gateway itself.
//!
//! Subcommands: `check-config FILE` (loads and validates a configuration the
//! way startup does, without opening sockets; with `--diff RUNNING` also
//! prints what changes from RUNNING to FILE), `certs` (development PKI),
//! `keys issuer --out PATH` (a new Ed25519 issuer key as PKCS#8 PEM; prints
//! its public `ed25519:` form for node.toml) and `keys hash-client-key`
//! (reads a client API key on stdin, prints the `key_hash` for
//! `[[client_keys]]`). `--version` prints the version, commit and whether
//! io_uring is available; `--log-format json` writes JSON log lines.

#![forbid(unsafe_code)]

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use argh::FromArgs;
use edge_bin::config::{ConfigDiff, EdgeConfig};
use edge_bin::link::shards::Lifecycle;
use edge_bin::plane::client_keys::client_key_hash_hex;
use edge_bin::plane::credentials::CredentialPlane;
use edge_bin::server;
use edge_bin::server::DrainEnd;
use iop_engine::build::{version_line, IoUring};
use iop_engine::rt::{self, notify, CoreList, LogFormat, Signal, SignalPipe};
use iop_engine::tls::{EdgeTlsAcceptor, HttpsAcceptor, NodeAllowList, TlsFiles, TlsMaterial};

/// IOP Edge: the OpenAI-compatible gateway Nodes dial into.
#[derive(FromArgs, Debug)]
#[argh(
    example = "{command_name} --config /etc/iop/edge.toml --cores 0-3\n\
               {command_name} check-config /etc/iop/edge.toml\n\
               {command_name} check-config --diff /etc/iop/edge.toml /etc/iop/edge.toml.new\n\
               {command_name} keys issuer --out /etc/iop/keys/issuer.key",
    note = "Environment:\n\
            \u{00A0} RUST_LOG          log filter, default info (e.g. info,edge_bin=debug)\n\
            \u{00A0} MONOIO_FORCE_LEGACY_DRIVER=1\n\
            \u{00A0}                   use epoll instead of io_uring\n\
            \u{00A0} NOTIFY_SOCKET     set by systemd (Type=notify-reload): READY=1 once\n\
            \u{00A0}                   listening, RELOADING=1 then READY=1 around a\n\
            \u{00A0}                   reload, STOPPING=1 at the first stop signal\n\
            \n\
            Signals:\n\
            \u{00A0} SIGHUP            reload edge.toml: nodes, providers, models, client\n\
            \u{00A0}                   keys, credential slots, limits, adapter settings,\n\
            \u{00A0}                   log paths and the TLS certificates (in a cluster\n\
            \u{00A0}                   the fleet is published to every Edge); a bad\n\
            \u{00A0}                   file keeps the running configuration\n\
            \u{00A0} SIGTERM, SIGINT   drain: stop accepting, let requests finish for at\n\
            \u{00A0}                   most edge.drain_grace_ms, exit 0; a second signal\n\
            \u{00A0}                   exits at once\n\
            \u{00A0} SIGUSR1           dump the latency histograms to stderr\n\
            \n\
            Docs: README.md, docs/deployment.md (systemd units, ports, TLS, keys,\n\
            upgrades) and examples/edge.toml."
)]
struct Args {
    /// path to edge.toml
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
    /// CPU cores to run on, taskset syntax (`0-3`, `0,2,5-7`); the first is
    /// the control shard. Default: 0.
    #[argh(option, default = "String::from(\"0\")")]
    cores: String,
    #[argh(subcommand)]
    command: Option<Command>,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
enum Command {
    CheckConfig(CheckConfigArgs),
    Certs(CertsArgs),
    Keys(KeysArgs),
}

/// Load and validate a configuration as startup does (every key, the TLS
/// certificates and keys, the issuer key and credential secrets, the access
/// log file) without opening sockets; exit 0 if it would start, 1 with the
/// file, key and reason if not. With --diff RUNNING, both files are checked
/// and what changes from RUNNING to FILE is printed, one line per change,
/// each setting marked live (a SIGHUP applies it) or needs a restart.
#[derive(FromArgs, Debug)]
#[argh(
    subcommand,
    name = "check-config",
    example = "{command_name} /etc/iop/edge.toml\n\
               {command_name} --diff /etc/iop/edge.toml /etc/iop/edge.toml.new"
)]
struct CheckConfigArgs {
    /// the configuration that runs: print what changes from it to FILE
    #[argh(option, arg_name = "RUNNING")]
    diff: Option<String>,
    /// the edge.toml to check
    #[argh(positional, arg_name = "FILE")]
    file: String,
}

fn log_format(text: &str) -> Result<LogFormat, String> {
    text.parse()
}

/// Credential-plane keys: the issuer key and client API key hashes.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "keys")]
struct KeysArgs {
    #[argh(subcommand)]
    command: KeysCommand,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
enum KeysCommand {
    Issuer(IssuerArgs),
    HashClientKey(HashClientKeyArgs),
}

/// Generate the Edge's Ed25519 issuer key as PKCS#8 PEM (mode 0600, never
/// overwritten; `openssl genpkey -algorithm ed25519` makes an equivalent
/// one) and print its public key for node.toml `[credentials]
/// issuer_public_key`.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "issuer")]
struct IssuerArgs {
    /// the private key file to create
    #[argh(option)]
    out: PathBuf,
}

/// Read a client API key from stdin (one trailing newline dropped) and print
/// its hash for edge.toml `[[client_keys]] key_hash`.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "hash-client-key")]
struct HashClientKeyArgs {}

/// Mint a development CA and Edge/Node certificates with SPIFFE identities.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "certs")]
struct CertsArgs {
    /// output directory (created if missing)
    #[argh(option)]
    out: PathBuf,
    /// SPIFFE trust domain (default iop.local)
    #[argh(option, default = "String::from(\"iop.local\")")]
    trust_domain: String,
    /// the Edge's identity name (default edge-1); repeat it for the Edges
    /// of a cluster: each gets edge-<name>.pem (the first is also edge.pem)
    #[argh(option)]
    edge_name: Vec<String>,
    /// a node id to mint a certificate for (repeatable; default node-a)
    #[argh(option)]
    node: Vec<String>,
    /// also mint an HTTPS server certificate (https.pem) for this host name
    /// or address, for [edge.client_tls] (repeatable)
    #[argh(option)]
    https_host: Vec<String>,
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("edge-bin: error: {message}");
    ExitCode::from(1)
}

fn main() -> ExitCode {
    let args: Args = argh::from_env();
    if args.version {
        println!("{}", version_line("edge-bin", IoUring::probe()));
        return ExitCode::SUCCESS;
    }
    iop_engine::rt::init_logging_as(args.log_format);
    match args.command {
        Some(Command::CheckConfig(c)) => match &c.diff {
            None => check_config(&c.file),
            Some(running) => check_config_diff(running, &c.file),
        },
        Some(Command::Certs(c)) => certs(c),
        Some(Command::Keys(k)) => keys(k),
        None => match args.config {
            Some(path) => serve(&path, &args.cores, args.log_format),
            None => fail("--config is required (or a subcommand: check-config, certs, keys)"),
        },
    }
}

/// What startup loads from the configuration before it opens a socket.
struct Loaded {
    cfg: EdgeConfig,
    credentials: Option<CredentialPlane>,
    acceptor: Option<EdgeTlsAcceptor>,
    client_tls: Option<HttpsAcceptor>,
}

impl Loaded {
    /// One line for `check-config`: what would run.
    fn summary(&self) -> String {
        let cfg = &self.cfg;
        let on = |on: bool| if on { "on" } else { "off" };
        format!(
            "edge {}: client_listen {}, node_listen {}, {} node(s), {} model(s), \
             {} client key(s), node TLS {}, client TLS {}, credential plane {}",
            cfg.edge.name,
            cfg.edge.client_listen,
            cfg.edge.node_listen,
            cfg.nodes.len(),
            cfg.models.len(),
            cfg.client_keys.len(),
            on(self.acceptor.is_some()),
            on(self.client_tls.is_some()),
            on(self.credentials.is_some()),
        )
    }
}

/// `check-config FILE`: [`load`] and report; nothing is bound.
fn check_config(path: &str) -> ExitCode {
    match load(path) {
        Ok(loaded) => {
            println!("{path}: ok");
            println!("{}", loaded.summary());
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

/// `check-config --diff RUNNING FILE`: [`load`]s both (RUNNING first; the
/// first error is reported and exits 1), then prints what changes from
/// RUNNING to FILE ([`ConfigDiff`]), or `no changes`; exits 0 either way.
fn check_config_diff(running: &str, next: &str) -> ExitCode {
    let running = match load(running) {
        Ok(loaded) => loaded.cfg,
        Err(e) => return fail(e),
    };
    let next = match load(next) {
        Ok(loaded) => loaded.cfg,
        Err(e) => return fail(e),
    };
    println!("{}", ConfigDiff::between(&running, &next));
    ExitCode::SUCCESS
}

/// Reads and validates everything startup needs from the configuration
/// file: the file itself, the credential plane (issuer key, slot secrets),
/// the node-link TLS identity (matching `edge.name`) and the client
/// listener's HTTPS identity. Opens no socket; the error names the file,
/// key and reason.
fn load(path: &str) -> Result<Loaded, String> {
    let cfg = EdgeConfig::load(path).map_err(|e| e.to_string())?;
    cfg.check_open_access().map_err(|e| e.to_string())?;
    // C1, C4: the issuer key and every slot secret are read once, here;
    // a bad one ends the process (S3) with the key and reason, never the
    // contents.
    let credentials =
        CredentialPlane::load(&cfg, &|name| std::env::var_os(name)).map_err(|e| e.to_string())?;
    if let Some(plane) = &credentials {
        tracing::info!(
            issuer_key_id = %plane.issuer_key_id(),
            lease_ttl_ms = plane.lease_ttl_ms(),
            "credential plane enabled"
        );
    }
    let source = cfg.source.display();
    let acceptor = match &cfg.tls {
        Some(files) => {
            let material = TlsMaterial::from_files(&TlsFiles::from(files))
                .map_err(|e| format!("{source}: tls: {e}"))?;
            let allowed = NodeAllowList::new(cfg.nodes.iter().map(|n| n.id.clone()));
            let a = EdgeTlsAcceptor::new(&material, &cfg.edge.trust_domain, allowed)
                .map_err(|e| format!("{source}: tls: {e}"))?;
            if a.local_identity().name() != cfg.edge.name {
                return Err(format!(
                    "{source}: edge.name: `{}` does not match the certificate identity {}",
                    cfg.edge.name,
                    a.local_identity().uri()
                ));
            }
            let own = a.local_certificate();
            tracing::info!(
                identity = %own.id.uri(),
                cert_serial = %own.serial_hex,
                not_after_unix_s = own.not_after_unix_s,
                "node-link certificate loaded (SIGHUP reloads it)"
            );
            Some(a)
        }
        None => {
            tracing::warn!("insecure_plaintext_nodes: accepting nodes without TLS (dev only, T5)");
            None
        }
    };
    let client_tls = match &cfg.client_tls {
        Some(files) => {
            let acceptor = HttpsAcceptor::from_files(files)
                .map_err(|e| format!("{source}: edge.client_tls: {e}"))?;
            let identity = acceptor.identity();
            tracing::info!(
                cert_serial = %identity.serial_hex,
                not_after_unix_s = identity.not_after_unix_s,
                client_certificates_required = identity.requires_client_cert,
                "client listener serves HTTPS"
            );
            Some(acceptor)
        }
        None => None,
    };
    if cfg.client_keys.is_empty() {
        tracing::warn!(
            "edge.allow_anonymous = true and no [[client_keys]]: every client is served without a key"
        );
    }
    Ok(Loaded {
        cfg,
        credentials,
        acceptor,
        client_tls,
    })
}

fn certs(args: CertsArgs) -> ExitCode {
    let nodes = if args.node.is_empty() {
        vec!["node-a".to_string()]
    } else {
        args.node
    };
    let https_hosts: Vec<&str> = args.https_host.iter().map(String::as_str).collect();
    let edge_names: Vec<&str> = if args.edge_name.is_empty() {
        vec!["edge-1"]
    } else {
        args.edge_name.iter().map(String::as_str).collect()
    };
    match iop_engine::certs::write_cluster_dev_certs(
        &args.out,
        &args.trust_domain,
        &edge_names,
        &nodes,
        &https_hosts,
    ) {
        Ok(files) => {
            println!("CA:   {}", files.ca_cert.display());
            println!(
                "edge: {} {}",
                files.edge.cert.display(),
                files.edge.key.display()
            );
            for (name, paths) in &files.edges {
                println!(
                    "edge {name}: {} {}",
                    paths.cert.display(),
                    paths.key.display()
                );
            }
            for (name, paths) in &files.nodes {
                println!(
                    "node {name}: {} {}",
                    paths.cert.display(),
                    paths.key.display()
                );
            }
            if let Some(paths) = &files.https {
                println!(
                    "https ({}): {} {}",
                    https_hosts.join(", "),
                    paths.cert.display(),
                    paths.key.display()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(format_args!("certs: {e}")),
    }
}

fn keys(args: KeysArgs) -> ExitCode {
    match args.command {
        KeysCommand::Issuer(a) => match iop_engine::keys::generate_issuer_key(&a.out) {
            Ok(public) => {
                println!("{}", iop_engine::keys::encode_issuer_public_key(&public));
                ExitCode::SUCCESS
            }
            Err(e) => fail(format_args!("keys issuer: {e}")),
        },
        KeysCommand::HashClientKey(HashClientKeyArgs {}) => {
            const MAX_KEY_BYTES: usize = 4096;
            // Allocated once at the cap so reading never reallocates (no
            // stray copies of the key).
            let mut key = zeroize::Zeroizing::new(Vec::with_capacity(MAX_KEY_BYTES + 1));
            if let Err(e) = std::io::stdin()
                .take(MAX_KEY_BYTES as u64 + 1)
                .read_to_end(&mut key)
            {
                return fail(format_args!("keys hash-client-key: reading stdin: {e}"));
            }
            if key.ends_with(b"\n") {
                key.pop();
                if key.ends_with(b"\r") {
                    key.pop();
                }
            }
            if key.is_empty() || key.len() > MAX_KEY_BYTES {
                return fail(format_args!(
                    "keys hash-client-key: expected one key of 1 to {MAX_KEY_BYTES} bytes on stdin"
                ));
            }
            println!("{}", client_key_hash_hex(&key));
            ExitCode::SUCCESS
        }
    }
}

/// The control shard's process plumbing: SIGTERM/SIGINT, SIGHUP, the
/// SIGUSR1 histogram dump, then the ready line and systemd `READY=1`.
fn control_setup(
    edge: &server::ShardedEdge,
) -> std::io::Result<(rt::StopFuture, rt::StopFuture, SignalPipe)> {
    let (shutdown, force) = rt::stop_signals()?;
    let hup = SignalPipe::install(Signal::Hup)?;
    iop_engine::metrics::spawn_usr1_dumper(iop_engine::metrics::Side::Edge)?;
    edge.announce()?;
    notify::notify(notify::State::Ready);
    Ok((shutdown, force, hup))
}

/// SIGHUP reloads the configuration: the fleet (nodes, providers, models),
/// the per-request limits, client keys and credential slots apply at once
/// (a credential secret it cannot read refuses the file), refreshes go to
/// ready nodes (K3), the access log file and the usage file are reopened,
/// and the node-link and client-listener certificates are re-read; an
/// invalid file keeps the running configuration (a bad certificate the
/// running certificate, and a log path that cannot be opened the running
/// log, the rest of the file applied).
///
/// `started` is what the process started with: the sections a reload does
/// not apply are compared against it on every reload, so the "needs a
/// restart" warning repeats for as long as the file differs from what
/// runs. `loaded` follows the last valid file (the applied sections and
/// the certificate paths).
///
/// In a cluster (`member`), a changed fleet is published for every Edge
/// to apply from etcd instead, and the rest of the file applies here
/// (`edge_bin::cluster::member::Member::reload`).
fn spawn_reloader(
    edge: Rc<edge_bin::link::edge::Edge>,
    member: Option<Rc<edge_bin::cluster::member::Member>>,
    tls: (Option<EdgeTlsAcceptor>, Option<HttpsAcceptor>),
    started: EdgeConfig,
    path: std::path::PathBuf,
    mut hup: SignalPipe,
) {
    monoio::spawn(async move {
        let mut loaded = started.clone();
        while hup.recv().await.is_ok() {
            notify::notify(notify::State::reloading_now());
            // A refused file keeps the running revision; a cluster's fleet
            // applied from etcd takes the next one too.
            let revision = edge.settings.running.get().revision + 1;
            let reloaded = match &member {
                // The member logs what it applied.
                Some(member) => member.reload(&path).await.map(|next| (next, None)),
                None => server::reload(&edge, &started, &path, revision)
                    .map(|(next, report)| (next, Some(report))),
            };
            // Certificates rotate even when the rest of the file is refused.
            let certificates = match &reloaded {
                Ok((next, _)) => next,
                Err(_) => &loaded,
            };
            server::reload_tls(
                certificates,
                tls.0.as_ref(),
                tls.1.as_ref(),
                edge.settings.peer_tls.as_ref(),
            );
            match reloaded {
                Ok((next, report)) => {
                    if let Some(report) = report {
                        server::log_report(&report, "configuration reloaded");
                    }
                    loaded = next;
                }
                Err(e) => tracing::error!(
                    error = %e,
                    "configuration reload failed; keeping the running configuration"
                ),
            }
            notify::notify(notify::State::Ready);
        }
    });
}

fn serve(path: &str, cores: &str, log_format: LogFormat) -> ExitCode {
    // Before any runtime thread allocates: large buffers go back to the OS
    // when freed (see iop_engine::memory for the measurements).
    iop_engine::memory::return_freed_memory();
    let Loaded {
        mut cfg,
        credentials,
        acceptor,
        client_tls,
    } = match load(path) {
        Ok(loaded) => loaded,
        Err(e) => return fail(e),
    };
    // An access log whose format edge.toml leaves open follows --log-format.
    if !cfg.access_log.format_explicit {
        cfg.access_log.format = match log_format {
            LogFormat::Text => edge_bin::config::Format::Text,
            LogFormat::Json => edge_bin::config::Format::Json,
        };
    }
    // C4: a secret read from the environment leaves it: not inherited by
    // children, not readable in /proc/<pid>/environ. Still one thread here.
    for name in cfg.secret_env_names() {
        match iop_engine::keys::scrub_env_var(name) {
            Ok(_) => tracing::debug!(variable = name, "secret removed from the environment"),
            Err(e) => tracing::warn!(
                variable = name,
                error = %e,
                "could not wipe the secret from the initial environment block; \
                 it stays readable in /proc/<pid>/environ (use secret_file)"
            ),
        }
    }
    let cores = match CoreList::parse_for_this_process(cores) {
        Ok(c) => c,
        Err(e) => return fail(format_args!("--cores {cores}: {e}")),
    };
    let shards = cores.cores().len();
    let edge = match server::ShardedEdge::bind(cfg.clone(), credentials, acceptor, shards) {
        Ok(edge) => Arc::new(edge.with_client_tls(client_tls)),
        Err(e) => return fail(e),
    };
    tracing::info!(
        driver = %rt::detect_driver(),
        cores = %cores,
        control_core = cores.control(),
        "edge-bin starting: Control on the first core, every core serves clients and nodes"
    );
    let drain_grace = Duration::from_millis(cfg.edge.drain_grace_ms);
    let config_path = std::path::PathBuf::from(path);
    let shared = edge.clone();
    let results = rt::run_shards(&cores, move |shard| {
        let (edge, cfg, config_path) = (shared.clone(), cfg.clone(), config_path.clone());
        async move {
            // Every shard serves clients: its histograms are allocated now,
            // not by its first request.
            iop_engine::metrics::prepare(iop_engine::metrics::Latency::of_side(
                iop_engine::metrics::Side::Edge,
            ));
            if !shard.is_control() {
                let stop = server::Stop {
                    shutdown: std::future::pending(),
                    force: std::future::pending(),
                    drain_grace,
                };
                let served = edge.serve_shard(shard.index, stop).await;
                if let Err(e) = &served {
                    // Control would wait for this shard's drain forever.
                    eprintln!("edge-bin: error: shard {}: {e}", shard.index);
                    std::process::exit(1);
                }
                return served;
            }
            let (state, listeners, acceptor) = edge.take(shard.index)?;
            // Signals are installed before the ready line, so a SIGTERM
            // right after it is never missed.
            let (shutdown, force, hup) = match control_setup(&edge) {
                Ok(s) => s,
                Err(e) => {
                    // Stop the worker shards too.
                    for step in [Lifecycle::Shutdown, Lifecycle::Force, Lifecycle::Exit] {
                        state.broadcast(step);
                    }
                    state.outbox_flushed().await;
                    return Err(e);
                }
            };
            let member = edge.start_member(&state)?;
            let tls = (edge.node_acceptor().cloned(), edge.client_tls().cloned());
            spawn_reloader(state.clone(), member.clone(), tls, cfg, config_path, hup);
            let stop = server::Stop {
                shutdown,
                force,
                drain_grace,
            };
            edge.serve_taken(state, member, listeners, acceptor, stop)
                .await
        }
    });
    // Every shard has drained: what the usage file, the budget file and
    // the access log have left is written.
    edge.usage_log().close();
    edge.client_keys().close_budget_file();
    edge.access_log().close();
    let mut results = results.into_iter();
    let result = match results.next() {
        Some(first) => first.map(|r| r.map(|end| end.drain)),
        None => Err(std::io::Error::other("no shard ran")),
    };
    for (index, other) in results.enumerate() {
        if let Err(e) | Ok(Err(e)) = other.map(|r| r.map(|_| ())) {
            tracing::error!(shard = index + 1, error = %e, "shard failed");
        }
    }
    match result {
        Ok(Ok(end)) => {
            match end {
                DrainEnd::Finished => tracing::info!("drained; shut down"),
                DrainEnd::GraceElapsed { in_flight } => tracing::warn!(
                    in_flight,
                    "edge.drain_grace_ms elapsed; shut down with requests in flight"
                ),
                DrainEnd::Forced { in_flight } => tracing::warn!(
                    in_flight,
                    "second signal; shut down with requests in flight"
                ),
            }
            ExitCode::SUCCESS
        }
        Ok(Err(e)) | Err(e) => fail(e),
    }
}
