//! `node-bin` entry point: arguments, configuration, runtime. See the
//! library crate (`node_bin`) for the daemon itself.
use std::process::ExitCode;

use argh::FromArgs;
use iop_engine::rt::{self, CoreList};
use iop_engine::tls::{NodeTlsConnector, TlsFiles, TlsMaterial};

use node_bin::config::NodeConfig;
use node_bin::supervisor::{self, Exit};

/// IOP Node: dials the Edge and serves its requests against local
/// inference servers.
#[derive(FromArgs, Debug)]
struct Args {
    /// path to node.toml
    #[argh(option)]
    config: String,
    /// CPU cores to run on, taskset syntax (`0-3`, `0,2,5-7`, `0-31:2`); the
    /// first is the control shard. Default: 0.
    #[argh(option, default = "String::from(\"0\")")]
    cores: String,
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
    eprintln!("node-bin: error: {message}");
    ExitCode::from(1)
}

fn main() -> ExitCode {
    let args: Args = argh::from_env();
    init_logging();
    // S3: every local configuration or credential problem exits 1.
    let cfg = match NodeConfig::load(&args.config) {
        Ok(cfg) => cfg,
        Err(e) => return fail(e),
    };
    let cores = match CoreList::parse_for_this_process(&args.cores) {
        Ok(c) => c,
        Err(e) => return fail(format_args!("--cores {}: {e}", args.cores)),
    };
    let connector = match &cfg.tls {
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
    if cores.cores().len() > 1 {
        tracing::warn!(
            cores = %cores,
            "multi-core mode is not implemented yet; running every shard on the first core"
        );
    }
    if let Err(e) = rt::pin_current_thread(cores.control()) {
        return fail(format_args!("pin to core {}: {e}", cores.control()));
    }
    tracing::info!(
        node_id = %cfg.node_id,
        edge = %cfg.edge_addr,
        driver = %rt::detect_driver(),
        core = cores.control(),
        "node-bin starting"
    );
    let result = rt::block_on(async move {
        let shutdown = supervisor::signal_shutdown()?;
        Ok::<Exit, std::io::Error>(supervisor::run(cfg, connector, shutdown).await)
    });
    match result {
        Ok(Ok(Exit::Shutdown)) => {
            tracing::info!("shutting down");
            ExitCode::SUCCESS
        }
        Ok(Ok(Exit::GaveUp)) => ExitCode::from(1),
        Ok(Err(e)) | Err(e) => fail(format_args!("runtime: {e}")),
    }
}
