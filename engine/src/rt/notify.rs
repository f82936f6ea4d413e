//! systemd readiness notification (the `sd_notify(3)` protocol) without
//! libsystemd.
//!
//! A service started with `Type=notify` (or `notify-reload`) finds the
//! service manager's socket in `NOTIFY_SOCKET`: an absolute path, or `@name`
//! for a Linux abstract socket (the `@` stands for the leading NUL byte).
//! Each state change is one datagram of newline-separated `KEY=VALUE` lines.
//!
//! ```text
//! start ─► bind/connect ─► READY=1
//! SIGHUP ─► RELOADING=1 + MONOTONIC_USEC=… ─► reload ─► READY=1
//! SIGTERM ─► STOPPING=1 ─► drain ─► exit
//! ```
//!
//! [`State`] formats the messages and [`NotifyAddr::parse`] reads the
//! variable (both pure); [`Notifier::send`] writes one datagram and
//! [`notify`] is the fire-and-forget form the binaries call: it does nothing
//! when `NOTIFY_SOCKET` is unset or empty, and logs (never returns) errors.

use std::ffi::OsStr;
use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::PathBuf;

use crate::clock;

/// The environment variable the service manager sets.
pub const NOTIFY_SOCKET_ENV: &str = "NOTIFY_SOCKET";

/// Bytes in `sockaddr_un.sun_path`: a path needs one more for its NUL
/// terminator, an abstract name one more for its leading NUL.
const SUN_PATH_BYTES: usize = 108;

/// Longest accepted socket path or abstract name, in bytes.
pub const MAX_ADDR_BYTES: usize = SUN_PATH_BYTES - 1;

/// A state change reported to the service manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// `READY=1`: startup finished (listening, or connected), or a reload
    /// finished.
    Ready,
    /// `RELOADING=1` with `MONOTONIC_USEC`: a configuration reload started
    /// at that `CLOCK_MONOTONIC` time (what `Type=notify-reload` expects).
    Reloading {
        /// `CLOCK_MONOTONIC` microseconds when the reload started.
        monotonic_usec: u64,
    },
    /// `STOPPING=1`: shutdown began.
    Stopping,
}

impl State {
    /// `Reloading` stamped with the current `CLOCK_MONOTONIC` time.
    pub fn reloading_now() -> Self {
        State::Reloading {
            monotonic_usec: clock::monotonic_raw_ns() / 1_000,
        }
    }

    /// The datagram's text: `KEY=VALUE` lines joined by `\n`.
    pub fn message(&self) -> String {
        match self {
            State::Ready => "READY=1".to_owned(),
            State::Reloading { monotonic_usec } => {
                format!("RELOADING=1\nMONOTONIC_USEC={monotonic_usec}")
            }
            State::Stopping => "STOPPING=1".to_owned(),
        }
    }
}

/// Where the service manager listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotifyAddr {
    /// A socket file (`/run/systemd/notify`).
    Path(PathBuf),
    /// A Linux abstract socket name, without the leading NUL (`@name` in
    /// the variable).
    Abstract(Vec<u8>),
}

/// A `NOTIFY_SOCKET` that cannot be used, or a failed send.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// The value is neither an absolute path nor an `@` abstract name (for
    /// example a relative path or a `vsock:` address, which IOP does not
    /// speak).
    #[error("{NOTIFY_SOCKET_ENV}={0:?} is neither an absolute socket path nor an @abstract name")]
    Unsupported(String),
    /// `@` with no name after it.
    #[error("{NOTIFY_SOCKET_ENV}=\"@\" names no abstract socket")]
    EmptyAbstractName,
    /// The path or name does not fit a Unix socket address.
    #[error("{NOTIFY_SOCKET_ENV} is {len_bytes} bytes long; at most {MAX_ADDR_BYTES} fit a Unix socket address")]
    TooLong {
        /// Length of the path or abstract name.
        len_bytes: usize,
    },
    /// Creating the socket or sending the datagram failed.
    #[error("notifying the service manager at {addr}: {source}")]
    Send {
        /// The address, rendered as in the variable.
        addr: String,
        /// The OS error.
        source: io::Error,
    },
}

impl NotifyAddr {
    /// Parses a `NOTIFY_SOCKET` value; `Ok(None)` for an empty value (as
    /// good as unset).
    pub fn parse(value: &OsStr) -> Result<Option<Self>, NotifyError> {
        let bytes = value.as_bytes();
        let addr = match bytes.first() {
            None => return Ok(None),
            Some(b'/') => NotifyAddr::Path(PathBuf::from(value)),
            Some(b'@') if bytes.len() == 1 => return Err(NotifyError::EmptyAbstractName),
            Some(b'@') => NotifyAddr::Abstract(bytes[1..].to_vec()),
            Some(_) => {
                return Err(NotifyError::Unsupported(
                    value.to_string_lossy().into_owned(),
                ))
            }
        };
        let len_bytes = match &addr {
            NotifyAddr::Path(path) => path.as_os_str().len(),
            NotifyAddr::Abstract(name) => name.len(),
        };
        if len_bytes > MAX_ADDR_BYTES {
            return Err(NotifyError::TooLong { len_bytes });
        }
        Ok(Some(addr))
    }

    fn socket_addr(&self) -> io::Result<SocketAddr> {
        match self {
            NotifyAddr::Path(path) => SocketAddr::from_pathname(path),
            NotifyAddr::Abstract(name) => SocketAddr::from_abstract_name(name),
        }
    }
}

impl std::fmt::Display for NotifyAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotifyAddr::Path(path) => write!(f, "{}", path.display()),
            NotifyAddr::Abstract(name) => write!(f, "@{}", String::from_utf8_lossy(name)),
        }
    }
}

/// Sends state changes to one service manager socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notifier {
    addr: NotifyAddr,
}

impl Notifier {
    /// A notifier for `addr`.
    pub fn new(addr: NotifyAddr) -> Self {
        Self { addr }
    }

    /// The notifier `NOTIFY_SOCKET` asks for; `Ok(None)` when it is unset or
    /// empty.
    pub fn from_env() -> Result<Option<Self>, NotifyError> {
        match std::env::var_os(NOTIFY_SOCKET_ENV) {
            None => Ok(None),
            Some(value) => Ok(NotifyAddr::parse(&value)?.map(Self::new)),
        }
    }

    /// Where it sends.
    pub fn addr(&self) -> &NotifyAddr {
        &self.addr
    }

    /// Sends `state` as one datagram from a fresh unbound socket. The
    /// socket is non-blocking: a manager that does not keep up makes this
    /// fail rather than stall the runtime thread.
    pub fn send(&self, state: State) -> Result<(), NotifyError> {
        let failed = |source: io::Error| NotifyError::Send {
            addr: self.addr.to_string(),
            source,
        };
        let message = state.message();
        let socket = UnixDatagram::unbound().map_err(failed)?;
        socket.set_nonblocking(true).map_err(failed)?;
        let to = self.addr.socket_addr().map_err(failed)?;
        let sent = socket
            .send_to_addr(message.as_bytes(), &to)
            .map_err(failed)?;
        if sent != message.len() {
            return Err(failed(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("sent {sent} of {} bytes", message.len()),
            )));
        }
        Ok(())
    }
}

/// Tells the service manager about `state` when `NOTIFY_SOCKET` is set;
/// does nothing otherwise. Failures are logged and never fatal.
pub fn notify(state: State) {
    let notifier = match Notifier::from_env() {
        Ok(Some(notifier)) => notifier,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!(error = %e, "systemd notification skipped");
            return;
        }
    };
    match notifier.send(state) {
        Ok(()) => tracing::debug!(state = %state.message().replace('\n', " "), "systemd notified"),
        Err(e) => tracing::warn!(error = %e, "systemd notification failed"),
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[test]
    fn messages_are_sd_notify_assignments() {
        assert_eq!(State::Ready.message(), "READY=1");
        assert_eq!(State::Stopping.message(), "STOPPING=1");
        assert_eq!(
            State::Reloading {
                monotonic_usec: 1_234_567
            }
            .message(),
            "RELOADING=1\nMONOTONIC_USEC=1234567"
        );
    }

    #[test]
    fn reloading_now_is_stamped_with_the_monotonic_clock() {
        let before_usec = clock::monotonic_raw_ns() / 1_000;
        let State::Reloading { monotonic_usec } = State::reloading_now() else {
            panic!("reloading_now is not Reloading");
        };
        let after_usec = clock::monotonic_raw_ns() / 1_000;
        assert!(before_usec <= monotonic_usec && monotonic_usec <= after_usec);
    }

    fn parse(value: &str) -> Result<Option<NotifyAddr>, NotifyError> {
        NotifyAddr::parse(OsStr::new(value))
    }

    #[test]
    fn parses_paths_and_abstract_names() {
        assert_eq!(
            parse("/run/systemd/notify").unwrap(),
            Some(NotifyAddr::Path(PathBuf::from("/run/systemd/notify")))
        );
        assert_eq!(
            parse("@/org/freedesktop/systemd1/notify/123").unwrap(),
            Some(NotifyAddr::Abstract(
                b"/org/freedesktop/systemd1/notify/123".to_vec()
            ))
        );
        assert_eq!(parse("").unwrap(), None);
        let longest = format!("/{}", "a".repeat(MAX_ADDR_BYTES - 1));
        assert_eq!(
            parse(&longest).unwrap(),
            Some(NotifyAddr::Path(PathBuf::from(&longest)))
        );
        let longest_name = format!("@{}", "b".repeat(MAX_ADDR_BYTES));
        assert_eq!(
            parse(&longest_name).unwrap(),
            Some(NotifyAddr::Abstract(vec![b'b'; MAX_ADDR_BYTES]))
        );
    }

    #[test]
    fn rejects_unusable_values_with_reasons() {
        let err = |value: &str| parse(value).unwrap_err().to_string();
        assert_eq!(
            err("run/notify"),
            "NOTIFY_SOCKET=\"run/notify\" is neither an absolute socket path nor an @abstract name"
        );
        assert_eq!(
            err("vsock:2:9999"),
            "NOTIFY_SOCKET=\"vsock:2:9999\" is neither an absolute socket path nor an @abstract name"
        );
        assert_eq!(err("@"), "NOTIFY_SOCKET=\"@\" names no abstract socket");
        assert_eq!(
            err(&format!("/{}", "a".repeat(MAX_ADDR_BYTES))),
            "NOTIFY_SOCKET is 108 bytes long; at most 107 fit a Unix socket address"
        );
        assert_eq!(
            err(&format!("@{}", "b".repeat(MAX_ADDR_BYTES + 1))),
            "NOTIFY_SOCKET is 108 bytes long; at most 107 fit a Unix socket address"
        );
    }

    #[test]
    fn renders_as_in_the_variable() {
        assert_eq!(
            NotifyAddr::Path(PathBuf::from("/run/n")).to_string(),
            "/run/n"
        );
        assert_eq!(NotifyAddr::Abstract(b"x/y".to_vec()).to_string(), "@x/y");
    }

    fn unique(prefix: &str) -> String {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        format!(
            "{prefix}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn receive(socket: &UnixDatagram) -> String {
        let mut buf = [0u8; 256];
        let len = socket.recv(&mut buf).unwrap();
        String::from_utf8(buf[..len].to_vec()).unwrap()
    }

    #[test]
    fn sends_one_datagram_per_state_to_a_socket_path() {
        let path = std::env::temp_dir().join(unique("iop-notify-test"));
        let listener = UnixDatagram::bind(&path).unwrap();
        let value = OsString::from(&path);
        let notifier = Notifier::new(NotifyAddr::parse(&value).unwrap().unwrap());
        notifier.send(State::Ready).unwrap();
        notifier
            .send(State::Reloading { monotonic_usec: 42 })
            .unwrap();
        notifier.send(State::Stopping).unwrap();
        assert_eq!(receive(&listener), "READY=1");
        assert_eq!(receive(&listener), "RELOADING=1\nMONOTONIC_USEC=42");
        assert_eq!(receive(&listener), "STOPPING=1");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn sends_to_an_abstract_socket() {
        let name = unique("iop-notify-test");
        let bound = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&bound).unwrap();
        let value = format!("@{name}");
        let notifier = Notifier::new(parse(&value).unwrap().unwrap());
        notifier.send(State::Ready).unwrap();
        assert_eq!(receive(&listener), "READY=1");
    }

    #[test]
    fn a_missing_socket_is_an_error_not_a_panic() {
        let path = std::env::temp_dir().join(unique("iop-notify-missing"));
        let notifier = Notifier::new(NotifyAddr::Path(path.clone()));
        let err = notifier.send(State::Ready).unwrap_err();
        let NotifyError::Send { addr, source } = &err else {
            panic!("expected a send error, got {err:?}");
        };
        assert_eq!(addr, &path.display().to_string());
        assert_eq!(source.kind(), io::ErrorKind::NotFound);
    }
}
