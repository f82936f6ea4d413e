//! The Node's metrics in Prometheus text format 0.0.4: answered to the
//! Edge's METRICS command (the Edge exposes them on its own `/metrics`,
//! labelled `node`), and optionally written as a node_exporter textfile
//! (`[metrics] textfile`, [`spawn_textfile_writer`]).
//!
//! ```text
//! per-core registries ─merged─► render ─┬─► METRICS command answer (+ session gauges)
//!                                       └─► <textfile>.tmp ─rename─► <textfile>, every interval
//! ```

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use iop_engine::metrics::buckets::{escape_label_value, write_family, write_sample};
use iop_engine::metrics::{self, process, Side};
use iop_wire::pb;

use crate::config::MetricsSpec;

/// The process-wide series: the Node's latency histograms and counters
/// (merged over cores), `iop_build_info` and the `process_*` series.
pub fn render() -> String {
    let mut out = metrics::render_prometheus(&metrics::merged(), Side::Node);
    process::render_build_and_process(&mut out);
    out
}

/// The session's gauges for a METRICS answer: active runs and tunnels, and
/// per adapter instance its capacity and the requests holding a slot.
pub fn render_session(
    transport: &pb::TransportStatus,
    providers: &[pb::ProviderLifecycle],
) -> String {
    let mut out = String::new();
    write_family(
        &mut out,
        "iop_node_active_runs",
        "gauge",
        "Normalized runs active on the Edge session now.",
    );
    write_sample(&mut out, "iop_node_active_runs", "", transport.active_runs);
    write_family(
        &mut out,
        "iop_node_active_tunnels",
        "gauge",
        "Provider tunnels active on the Edge session now.",
    );
    write_sample(
        &mut out,
        "iop_node_active_tunnels",
        "",
        transport.active_tunnels,
    );
    for (name, help, pick) in [
        (
            "iop_node_adapter_capacity",
            "Capacity of the adapter instance's gate.",
            (|p: &pb::ProviderLifecycle| p.capacity) as fn(&pb::ProviderLifecycle) -> u32,
        ),
        (
            "iop_node_adapter_in_flight",
            "Requests holding a slot of the adapter instance now.",
            |p| p.in_flight,
        ),
    ] {
        write_family(&mut out, name, "gauge", help);
        for p in providers {
            let mut labels = String::new();
            let _ = write!(labels, "adapter=\"{}\"", escape_label_value(&p.adapter_key));
            write_sample(&mut out, name, &labels, pick(p));
        }
    }
    out
}

/// Writes `text` to `path` atomically: into `<path>.tmp` in the same
/// directory, then renamed over `path`, so node_exporter never reads half
/// a file.
pub fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)
}

/// Starts a thread that writes [`render`] to `spec.textfile` every
/// `spec.textfile_interval` (the first time at once); nothing without a
/// textfile. A failed write is logged (once per run of failures) and
/// retried at the next interval.
pub fn spawn_textfile_writer(spec: &MetricsSpec) -> std::io::Result<()> {
    let Some(path) = spec.textfile.clone() else {
        return Ok(());
    };
    let interval = spec.textfile_interval.max(Duration::from_secs(1));
    std::thread::Builder::new()
        .name("iop-metrics-textfile".into())
        .spawn(move || {
            let mut failing = false;
            loop {
                match write_atomically(&path, &render()) {
                    Ok(()) => failing = false,
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(path = %path.display(), error = %e, "metrics textfile not written; retrying every interval");
                    }
                    Err(_) => {}
                }
                std::thread::sleep(interval);
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_gauges_are_exact() {
        let transport = pb::TransportStatus {
            active_runs: 2,
            active_tunnels: 1,
            ..Default::default()
        };
        let providers = [pb::ProviderLifecycle {
            adapter_key: "vllm".into(),
            capacity: 8,
            in_flight: 3,
            ..Default::default()
        }];
        assert_eq!(
            render_session(&transport, &providers),
            "# HELP iop_node_active_runs Normalized runs active on the Edge session now.\n\
             # TYPE iop_node_active_runs gauge\n\
             iop_node_active_runs 2\n\
             # HELP iop_node_active_tunnels Provider tunnels active on the Edge session now.\n\
             # TYPE iop_node_active_tunnels gauge\n\
             iop_node_active_tunnels 1\n\
             # HELP iop_node_adapter_capacity Capacity of the adapter instance's gate.\n\
             # TYPE iop_node_adapter_capacity gauge\n\
             iop_node_adapter_capacity{adapter=\"vllm\"} 8\n\
             # HELP iop_node_adapter_in_flight Requests holding a slot of the adapter instance now.\n\
             # TYPE iop_node_adapter_in_flight gauge\n\
             iop_node_adapter_in_flight{adapter=\"vllm\"} 3\n"
        );
    }

    #[test]
    fn the_textfile_is_replaced_whole() {
        let dir = std::env::temp_dir().join(format!("iop-textfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("iop_node.prom");
        write_atomically(&path, "a 1\n").unwrap();
        write_atomically(&path, "a 2\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "a 2\n");
        assert!(!dir.join("iop_node.prom.tmp").exists());
        let text = render();
        assert!(text.contains("# TYPE iop_node_provider_call_duration_seconds histogram\n"));
        assert!(text.contains("# TYPE iop_build_info gauge\n"));
        assert!(text.contains("# TYPE process_open_fds gauge\n"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
