//! A real etcd for tests: one member or several on loopback as one
//! cluster, each on free ports with its data directory in a fresh temp
//! directory. Members can be stopped (SIGKILL), frozen (SIGSTOP) and
//! restarted; every process still running is killed by its PID when the
//! cluster is dropped.
//!
//! Needs the `etcd` binary (`/usr/bin/etcd` or `etcd` on `PATH`). Without
//! it, starting a cluster panics — the test fails and says to run
//! `apt-get install etcd-server`; it is never skipped.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// How long a cluster may take to elect a leader and answer `/health`.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Attempts at starting a cluster when a port was taken meanwhile.
const START_ATTEMPTS: usize = 5;

/// The etcd binary: `/usr/bin/etcd`, else `etcd` found on `PATH`. Panics
/// with the install command when there is none.
pub fn etcd_binary() -> PathBuf {
    let system = PathBuf::from("/usr/bin/etcd");
    if system.is_file() {
        return system;
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("etcd"))
            .find(|candidate| candidate.is_file())
    });
    on_path.unwrap_or_else(|| {
        panic!(
            "etcd is not installed (no /usr/bin/etcd, no etcd on PATH): \
             run `apt-get install etcd-server` (scripts/test.sh does when root)"
        )
    })
}

#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// A running etcd cluster; see the module docs.
#[derive(Debug)]
pub struct EtcdCluster {
    binary: PathBuf,
    dir: PathBuf,
    initial_cluster: String,
    members: Vec<Member>,
}

impl EtcdCluster {
    /// Starts `size` members as one cluster and waits until every member
    /// says it is healthy (a leader is elected). Retries with new ports if
    /// one was taken between choosing and binding it.
    pub fn start(size: usize) -> EtcdCluster {
        assert!(size >= 1, "a cluster has at least one member");
        let binary = etcd_binary();
        let mut last_failure = String::new();
        for _ in 0..START_ATTEMPTS {
            let mut cluster = EtcdCluster::spawn(binary.clone(), size);
            match cluster.wait_healthy() {
                Ok(()) => return cluster,
                // Dropping the cluster kills what did start.
                Err(failure) => last_failure = failure,
            }
        }
        panic!(
            "etcd cluster of {size} did not start after {START_ATTEMPTS} attempts: {last_failure}"
        );
    }

    fn spawn(binary: PathBuf, size: usize) -> EtcdCluster {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "iop-etcd-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("create etcd temp dir");
        let ports = free_ports(2 * size);
        let members: Vec<Member> = (0..size)
            .map(|index| Member {
                name: format!("m{index}"),
                client_port: ports[2 * index],
                peer_port: ports[2 * index + 1],
                data_dir: dir.join(format!("m{index}.etcd")),
                log: dir.join(format!("m{index}.log")),
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            binary,
            dir,
            initial_cluster,
            members,
        };
        for index in 0..size {
            cluster.spawn_member(index);
        }
        cluster
    }

    fn spawn_member(&mut self, index: usize) {
        let member = &self.members[index];
        let client_url = format!("http://127.0.0.1:{}", member.client_port);
        let peer_url = format!("http://127.0.0.1:{}", member.peer_port);
        let log = File::options()
            .create(true)
            .append(true)
            .open(&member.log)
            .expect("open etcd log");
        let log_err = log.try_clone().expect("clone etcd log handle");
        let child = Command::new(&self.binary)
            .arg("--name")
            .arg(&member.name)
            .arg("--data-dir")
            .arg(&member.data_dir)
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-state", "new"])
            .args([
                "--initial-cluster-token",
                &format!("iop-test-{}", self.dir.display()),
            ])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.binary.display()));
        self.members[index].child = Some(child);
    }

    /// The number of members.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Client endpoint (`127.0.0.1:port`) of member `index`.
    pub fn endpoint(&self, index: usize) -> String {
        format!("127.0.0.1:{}", self.members[index].client_port)
    }

    /// Client endpoints of every member, in member order.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Waits until every running member answers `/health` with
    /// `{"health":"true"}`; the error says which member did not, with the
    /// end of its log.
    pub fn wait_healthy(&mut self) -> Result<(), String> {
        let deadline = iop_engine::clock::now() + START_TIMEOUT;
        for index in 0..self.members.len() {
            if self.members[index].child.is_none() {
                continue;
            }
            loop {
                if let Some(status) = self.exited(index) {
                    return Err(format!(
                        "member m{index} exited ({status}); log:\n{}",
                        self.log_tail(index)
                    ));
                }
                let health = http(&self.endpoint(index), "GET", "/health", "");
                if matches!(&health, Ok((200, body)) if body.contains(r#""health":"true""#)) {
                    break;
                }
                if iop_engine::clock::now() >= deadline {
                    return Err(format!(
                        "member m{index} not healthy within {START_TIMEOUT:?} (last: {health:?}); log:\n{}",
                        self.log_tail(index)
                    ));
                }
                thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// Index of the member that is the Raft leader, as member 0..n reports
    /// it (`/v3/maintenance/status`).
    pub fn leader(&self) -> usize {
        let mut ids = Vec::new();
        let mut leader = None;
        for index in 0..self.members.len() {
            let (status, body) = http(
                &self.endpoint(index),
                "POST",
                "/v3/maintenance/status",
                "{}",
            )
            .unwrap_or_else(|e| panic!("status of m{index}: {e}"));
            assert_eq!(status, 200, "status of m{index}: {body}");
            let answer: serde_json::Value = serde_json::from_str(&body).expect("status is JSON");
            ids.push(answer["header"]["member_id"].as_str().map(str::to_owned));
            leader = answer["leader"].as_str().map(str::to_owned).or(leader);
        }
        ids.iter()
            .position(|id| id.is_some() && *id == leader)
            .unwrap_or_else(|| panic!("no member is the leader {leader:?} among {ids:?}"))
    }

    /// Compacts the store up to `revision` (older revisions can no longer
    /// be watched), through member 0.
    pub fn compact(&self, revision: i64) {
        let body = format!(r#"{{"revision":"{revision}","physical":true}}"#);
        let (status, answer) = http(&self.endpoint(0), "POST", "/v3/kv/compaction", &body)
            .unwrap_or_else(|e| panic!("compaction: {e}"));
        assert_eq!(status, 200, "compaction: {answer}");
    }

    /// Kills member `index` (SIGKILL) and waits for it to exit.
    pub fn stop(&mut self, index: usize) {
        if let Some(mut child) = self.members[index].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills every member.
    pub fn stop_all(&mut self) {
        for index in 0..self.members.len() {
            self.stop(index);
        }
    }

    /// Starts a stopped member again on its ports and data directory, and
    /// waits until the cluster is healthy.
    pub fn restart(&mut self, index: usize) {
        assert!(self.members[index].child.is_none(), "m{index} is running");
        self.spawn_member(index);
        if let Err(failure) = self.wait_healthy() {
            panic!("restart of m{index}: {failure}");
        }
    }

    /// Freezes member `index` (SIGSTOP): its sockets still accept
    /// connections, but nothing answers.
    pub fn freeze(&self, index: usize) {
        self.signal(index, Signal::SIGSTOP);
    }

    /// Lets a frozen member run again (SIGCONT).
    pub fn thaw(&self, index: usize) {
        self.signal(index, Signal::SIGCONT);
    }

    fn signal(&self, index: usize, signal: Signal) {
        let child = self.members[index]
            .child
            .as_ref()
            .unwrap_or_else(|| panic!("m{index} is not running"));
        let pid = Pid::from_raw(i32::try_from(child.id()).expect("pid fits i32"));
        kill(pid, signal).unwrap_or_else(|e| panic!("{signal} to m{index}: {e}"));
    }

    fn exited(&mut self, index: usize) -> Option<std::process::ExitStatus> {
        let child = self.members[index].child.as_mut()?;
        child.try_wait().ok().flatten()
    }

    fn log_tail(&self, index: usize) -> String {
        let text = fs::read_to_string(&self.members[index].log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// The temp directory holding the members' data and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        // SIGKILL by PID ends frozen members too.
        self.stop_all();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// `count` distinct free loopback ports: each bound to port 0 at once,
/// then all released. Another process may take one before etcd binds it;
/// [`EtcdCluster::start`] retries then.
fn free_ports(count: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("local addr").port())
        .collect()
}

/// One blocking HTTP/1.1 exchange with `Connection: close`: the status and
/// the body (read to the close; the answers used here are not chunked).
fn http(endpoint: &str, method: &str, path: &str, body: &str) -> Result<(u16, String), String> {
    let mut stream = TcpStream::connect(endpoint).map_err(|e| format!("connect: {e}"))?;
    let timeout = Some(Duration::from_secs(5));
    stream
        .set_read_timeout(timeout)
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(timeout)
        .map_err(|e| e.to_string())?;
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {endpoint}\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|e| format!("read: {e}"))?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no head in {response:?}"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("no status in {head:?}"))?;
    Ok((status, body.to_owned()))
}
