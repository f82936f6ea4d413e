//! `edge-bin` entry point: arguments, configuration, listeners. See the
//! library crate (`edge_bin`) for the gateway itself.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;

use argh::FromArgs;
use edge_bin::config::{self, EdgeConfig};
use edge_bin::control::{self, Control, ControlSpec, DispatchKind};
use edge_bin::openai::ModelEntry;
use edge_bin::state::{Edge, Settings};
use edge_bin::{nodes, surface};
use iop_engine::rt::{self, CoreList, Signal, SignalPipe};
use iop_engine::tls::{EdgeTlsAcceptor, NodeAllowList, TlsFiles, TlsMaterial};
use iop_wire::pb;

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

/// Maps the validated config to the control machine's static spec.
fn control_spec(cfg: &EdgeConfig) -> ControlSpec {
    let credential_leases_required = false;
    let nodes = cfg
        .nodes
        .iter()
        .map(|n| control::NodeSpec {
            id: n.id.clone(),
            config: n.config_payload(1, credential_leases_required),
            providers: n
                .providers
                .iter()
                .map(|p| {
                    let kind = match n.adapter(&p.adapter).map(|a| &a.kind) {
                        Some(config::AdapterKind::Ollama) => DispatchKind::Run,
                        _ => DispatchKind::Tunnel,
                    };
                    control::ProviderSpec {
                        id: p.id.clone(),
                        adapter: p.adapter.clone(),
                        target: p.target.clone(),
                        capacity: p.capacity,
                        long_context_capacity: p.long_context_capacity,
                        response_stall_timeout_ms: p.response_stall_timeout_ms,
                        category: match p.category {
                            config::ProviderCategory::Api => pb::ProviderCategory::Api,
                            config::ProviderCategory::LocalInference => {
                                pb::ProviderCategory::LocalInference
                            }
                        },
                        kind,
                        enabled: p.enabled,
                    }
                })
                .collect(),
        })
        .collect();
    let models = cfg
        .models
        .iter()
        .map(|m| control::ModelSpec {
            name: m.name.clone(),
            providers: m
                .providers
                .iter()
                .map(|r| control::ProviderKey {
                    node_id: r.node_id.clone(),
                    provider_id: r.provider_id.clone(),
                })
                .collect(),
        })
        .collect();
    ControlSpec { nodes, models }
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
    let settings = Settings {
        max_request_body_bytes: cfg.edge.max_request_body_bytes,
        models: cfg
            .models
            .iter()
            .map(|m| ModelEntry {
                id: m.name.clone(),
                owned_by: m.owned_by.clone(),
            })
            .collect(),
        started_unix_sec: iop_engine::clock::unix_ms() / 1000,
    };
    let edge = Rc::new(Edge::new(Control::new(control_spec(&cfg)), settings));
    tracing::info!(
        driver = %rt::detect_driver(),
        core = cores.control(),
        "edge-bin starting"
    );
    let result = rt::block_on(run(edge, cfg, acceptor));
    match result {
        Ok(Ok(())) => {
            tracing::info!("shut down");
            ExitCode::SUCCESS
        }
        Ok(Err(e)) | Err(e) => fail(e),
    }
}

async fn run(
    edge: Rc<Edge>,
    cfg: EdgeConfig,
    acceptor: Option<Rc<EdgeTlsAcceptor>>,
) -> std::io::Result<()> {
    let mut term = SignalPipe::install(Signal::Term)?;
    let mut int = SignalPipe::install(Signal::Int)?;
    let node_listener = monoio::net::TcpListener::bind(cfg.edge.node_listen).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("bind edge.node_listen {}: {e}", cfg.edge.node_listen),
        )
    })?;
    let client_listener = monoio::net::TcpListener::bind(cfg.edge.client_listen).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("bind edge.client_listen {}: {e}", cfg.edge.client_listen),
        )
    })?;
    let client_addr = client_listener.local_addr()?;
    let node_addr = node_listener.local_addr()?;
    tracing::info!(client = %client_addr, nodes = %node_addr, "listening");
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "IOP_READY edge client={client_addr} nodes={node_addr}")?;
        out.flush()?;
    }
    {
        let edge = edge.clone();
        monoio::spawn(async move {
            loop {
                match iop_engine::http::accept(&node_listener).await {
                    Ok((tcp, _)) => {
                        monoio::spawn(nodes::serve(edge.clone(), tcp, acceptor.clone()));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "node accept failed");
                        monoio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                }
            }
        });
    }
    monoio::spawn(async move {
        loop {
            match iop_engine::http::accept(&client_listener).await {
                Ok((tcp, _)) => {
                    monoio::spawn(surface::serve(edge.clone(), tcp));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "client accept failed");
                    monoio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
    monoio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    Ok(())
}
