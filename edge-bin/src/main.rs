//! `edge-bin` entry point: arguments, configuration, listeners. See the
//! library crate (`edge_bin`) for the gateway itself.

use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;

use argh::FromArgs;
use edge_bin::config::EdgeConfig;
use edge_bin::server;
use iop_engine::rt::{self, CoreList, Signal, SignalPipe};
use iop_engine::tls::{EdgeTlsAcceptor, NodeAllowList, TlsFiles, TlsMaterial};

/// IOP Edge: the OpenAI-compatible gateway Nodes dial into.
#[derive(FromArgs, Debug)]
struct Args {
    /// path to edge.toml
    #[argh(option)]
    config: Option<String>,
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
    Certs(CertsArgs),
}

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
    /// the Edge's identity name (default edge-1)
    #[argh(option, default = "String::from(\"edge-1\")")]
    edge_name: String,
    /// a node id to mint a certificate for (repeatable; default node-a)
    #[argh(option)]
    node: Vec<String>,
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("edge-bin: error: {message}");
    ExitCode::from(1)
}

fn main() -> ExitCode {
    let args: Args = argh::from_env();
    init_logging();
    match args.command {
        Some(Command::Certs(c)) => certs(c),
        None => match args.config {
            Some(path) => serve(&path, &args.cores),
            None => fail("--config is required (or a subcommand: certs)"),
        },
    }
}

fn certs(args: CertsArgs) -> ExitCode {
    let nodes = if args.node.is_empty() {
        vec!["node-a".to_string()]
    } else {
        args.node
    };
    match iop_engine::certs::write_dev_certs(&args.out, &args.trust_domain, &args.edge_name, &nodes)
    {
        Ok(files) => {
            println!("CA:   {}", files.ca_cert.display());
            println!(
                "edge: {} {}",
                files.edge.cert.display(),
                files.edge.key.display()
            );
            for (name, paths) in &files.nodes {
                println!(
                    "node {name}: {} {}",
                    paths.cert.display(),
                    paths.key.display()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(format_args!("certs: {e}")),
    }
}

fn serve(path: &str, cores: &str) -> ExitCode {
    let cfg = match EdgeConfig::load(path) {
        Ok(cfg) => cfg,
        Err(e) => return fail(e),
    };
    let cores = match CoreList::parse_for_this_process(cores) {
        Ok(c) => c,
        Err(e) => return fail(format_args!("--cores {cores}: {e}")),
    };
    let acceptor = match &cfg.tls {
        Some(files) => {
            let files = TlsFiles {
                ca_path: files.ca.clone(),
                cert_path: files.cert.clone(),
                key_path: files.key.clone(),
            };
            let material = match TlsMaterial::from_files(&files) {
                Ok(m) => m,
                Err(e) => return fail(format_args!("{}: tls: {e}", cfg.source.display())),
            };
            let allowed = NodeAllowList::new(cfg.nodes.iter().map(|n| n.id.clone()));
            match EdgeTlsAcceptor::new(&material, &cfg.edge.trust_domain, allowed) {
                Ok(a) => {
                    if a.local_identity().name() != cfg.edge.name {
                        return fail(format_args!(
                            "{}: edge.name: `{}` does not match the certificate identity {}",
                            cfg.source.display(),
                            cfg.edge.name,
                            a.local_identity().uri()
                        ));
                    }
                    Some(Rc::new(a))
                }
                Err(e) => return fail(format_args!("{}: tls: {e}", cfg.source.display())),
            }
        }
        None => {
            tracing::warn!("insecure_plaintext_nodes: accepting nodes without TLS (dev only, T5)");
            None
        }
    };
    if cores.cores().len() > 1 {
        tracing::warn!(
            cores = %cores,
            "multi-core mode is not implemented yet; running every shard on the first core"
        );
    }
    if let Err(e) = rt::pin_current_thread(cores.control()) {
        return fail(format_args!("pin to core {}: {e}", cores.control()));
    }
    let edge = server::edge_state(&cfg);
    tracing::info!(
        driver = %rt::detect_driver(),
        core = cores.control(),
        "edge-bin starting"
    );
    let result = rt::block_on(async move {
        let mut term = SignalPipe::install(Signal::Term)?;
        let mut int = SignalPipe::install(Signal::Int)?;
        let listeners = server::Listeners::bind(&cfg)?;
        listeners.announce()?;
        let shutdown = async move {
            monoio::select! {
                _ = term.recv() => {},
                _ = int.recv() => {},
            }
        };
        server::serve(edge, listeners, acceptor, shutdown).await;
        Ok::<(), std::io::Error>(())
    });
    match result {
        Ok(Ok(())) => {
            tracing::info!("shut down");
            ExitCode::SUCCESS
        }
        Ok(Err(e)) | Err(e) => fail(e),
    }
}
