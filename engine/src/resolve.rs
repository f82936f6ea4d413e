//! Host name resolution that never blocks a core.
//!
//! `getaddrinfo` blocks its thread for as long as the resolver takes (a
//! slow or unreachable DNS server: seconds). Called on a monoio core it
//! would stall every stream on that core, so names are resolved on a small
//! pool of resolver threads and cached:
//!
//! ```text
//! resolve(host, port)
//!   ├─ IP literal ─────────────────────────────► the address, no lookup
//!   ├─ cached, younger than FRESH_FOR ─────────► the cached addresses
//!   ├─ cached, younger than STALE_FOR ─────────► the cached addresses, and a
//!   │                                             refresh queued (stale while
//!   │                                             revalidate: no caller waits)
//!   └─ otherwise ─► job to a resolver thread ─► await its answer (the core
//!                    keeps running other tasks) ─► cached, returned
//! ```
//!
//! Bounds: [`RESOLVER_THREADS`] threads, started on first use; at most
//! [`MAX_QUEUED_LOOKUPS`] lookups waiting (more fail at once with
//! `WouldBlock`: a resolver that has fallen this far behind will not catch
//! up); one lookup in flight per name (later callers wait for it); at most
//! [`MAX_CACHED_NAMES`] names cached. A failed lookup is remembered for
//! [`NEGATIVE_FOR`] so a missing name does not turn every request into a
//! DNS query. A caller that stops waiting (its request was cancelled) drops
//! its receiver; the lookup still completes and fills the cache.
//!
//! The process-wide cache is keyed by `(host, port)` and shared by every
//! core (it is touched once per new connection, not per request: provider
//! connections are pooled). Only [`crate::clock`] is read for its times.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::pin::Pin;
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::clock;

/// Resolver threads.
pub const RESOLVER_THREADS: usize = 2;
/// Most lookups waiting for a resolver thread.
pub const MAX_QUEUED_LOOKUPS: usize = 256;
/// Most names kept in the cache; past it the oldest entry is evicted.
pub const MAX_CACHED_NAMES: usize = 1024;
/// A cached answer is used without a lookup for this long.
pub const FRESH_FOR: Duration = Duration::from_secs(30);
/// A cached answer older than [`FRESH_FOR`] but younger than this is still
/// used while a refresh runs in the background.
pub const STALE_FOR: Duration = Duration::from_secs(300);
/// A failed lookup is answered from the cache for this long.
pub const NEGATIVE_FOR: Duration = Duration::from_secs(5);

/// One cached answer.
#[derive(Debug, Clone)]
struct Entry {
    answer: Result<Arc<[SocketAddr]>, (io::ErrorKind, String)>,
    resolved_at: Instant,
}

/// What the cache says about a name at a given time (pure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Use these addresses; no lookup needed.
    Fresh(Arc<[SocketAddr]>),
    /// Use these addresses, and refresh them in the background.
    Stale(Arc<[SocketAddr]>),
    /// The last lookup failed recently: fail the same way.
    Failed(io::ErrorKind, String),
    /// Nothing usable: look the name up and wait.
    Missing,
}

/// The cache's policy, without threads or a clock.
#[derive(Debug, Default)]
pub struct Cache {
    entries: HashMap<(String, u16), Entry>,
}

impl Cache {
    /// What to do for `host:port` at `now`.
    pub fn lookup(&self, host: &str, port: u16, now: Instant) -> Lookup {
        let Some(entry) = self.entries.get(&(host.to_owned(), port)) else {
            return Lookup::Missing;
        };
        let age = now.saturating_duration_since(entry.resolved_at);
        match &entry.answer {
            Ok(addrs) if age < FRESH_FOR => Lookup::Fresh(addrs.clone()),
            Ok(addrs) if age < STALE_FOR => Lookup::Stale(addrs.clone()),
            Err((kind, message)) if age < NEGATIVE_FOR => Lookup::Failed(*kind, message.clone()),
            _ => Lookup::Missing,
        }
    }

    /// Records the answer of a lookup finished at `now`. A failed refresh
    /// of a name that still has a usable answer keeps that answer (a DNS
    /// hiccup does not take a working provider away) until it goes stale.
    pub fn record(
        &mut self,
        host: &str,
        port: u16,
        answer: &io::Result<Vec<SocketAddr>>,
        now: Instant,
    ) {
        let key = (host.to_owned(), port);
        let answer = match answer {
            Ok(addrs) => Ok(Arc::from(addrs.as_slice())),
            Err(e) => {
                if let Some(Entry { answer: Ok(_), .. }) = self.entries.get(&key) {
                    return;
                }
                Err((e.kind(), e.to_string()))
            }
        };
        if !self.entries.contains_key(&key) && self.entries.len() >= MAX_CACHED_NAMES {
            let oldest = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.resolved_at)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                self.entries.remove(&oldest);
            }
        }
        self.entries.insert(
            key,
            Entry {
                answer,
                resolved_at: now,
            },
        );
    }

    /// Names cached.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A lookup's answer handed from a resolver thread to the waiting task.
#[derive(Debug, Default)]
struct Slot {
    answer: Option<io::Result<Arc<[SocketAddr]>>>,
    waker: Option<Waker>,
}

type SharedSlot = Arc<Mutex<Slot>>;

/// Waits for a resolver thread's answer (cross-thread wake).
struct Answer(SharedSlot);

impl Future for Answer {
    type Output = io::Result<Arc<[SocketAddr]>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match slot.answer.take() {
            Some(answer) => Poll::Ready(answer),
            None => {
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

fn deliver(slot: &SharedSlot, answer: io::Result<Arc<[SocketAddr]>>) {
    let waker = {
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        slot.answer = Some(answer);
        slot.waker.take()
    };
    // Woken outside the lock: the waker may run the task's poll inline.
    if let Some(waker) = waker {
        waker.wake();
    }
}

/// The process's resolver: its cache, the lookups in flight and the job
/// queue of its threads.
struct Resolver {
    cache: Mutex<Cache>,
    /// Per name in flight, everyone waiting for it.
    in_flight: Mutex<HashMap<(String, u16), Vec<SharedSlot>>>,
    jobs: SyncSender<(String, u16)>,
}

static RESOLVER: OnceLock<Option<Resolver>> = OnceLock::new();

fn resolver() -> io::Result<&'static Resolver> {
    RESOLVER
        .get_or_init(|| {
            let (jobs, queue) = mpsc::sync_channel::<(String, u16)>(MAX_QUEUED_LOOKUPS);
            let queue = Arc::new(Mutex::new(queue));
            let mut started = 0;
            for i in 0..RESOLVER_THREADS {
                let queue = queue.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("iop-resolver-{i}"))
                    .spawn(move || resolver_thread(&queue));
                match spawned {
                    Ok(_) => started += 1,
                    Err(e) => tracing::error!(error = %e, "could not start a resolver thread"),
                }
            }
            (started > 0).then(|| Resolver {
                cache: Mutex::new(Cache::default()),
                in_flight: Mutex::new(HashMap::new()),
                jobs,
            })
        })
        .as_ref()
        .ok_or_else(|| io::Error::other("no resolver thread could be started"))
}

fn resolver_thread(queue: &Mutex<mpsc::Receiver<(String, u16)>>) {
    loop {
        let job = {
            let queue = queue.lock().unwrap_or_else(PoisonError::into_inner);
            queue.recv()
        };
        let Ok((host, port)) = job else { return };
        let answer = (host.as_str(), port)
            .to_socket_addrs()
            .map(Iterator::collect::<Vec<_>>)
            .and_then(|addrs| {
                if addrs.is_empty() {
                    Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("{host} resolved to no address"),
                    ))
                } else {
                    Ok(addrs)
                }
            });
        let Ok(resolver) = resolver() else { return };
        resolver
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record(&host, port, &answer, clock::now());
        let waiting = resolver
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(host.clone(), port))
            .unwrap_or_default();
        let shared: io::Result<Arc<[SocketAddr]>> = answer.map(Arc::from);
        for slot in &waiting {
            let copy = match &shared {
                Ok(addrs) => Ok(addrs.clone()),
                Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
            };
            deliver(slot, copy);
        }
    }
}

impl Resolver {
    /// Queues a lookup of `host:port` unless one is in flight; `waiter`
    /// (if any) gets its answer.
    fn submit(&self, host: &str, port: u16, waiter: Option<SharedSlot>) -> io::Result<()> {
        let key = (host.to_owned(), port);
        let mut in_flight = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(waiting) = in_flight.get_mut(&key) {
            waiting.extend(waiter);
            return Ok(());
        }
        match self.jobs.try_send(key.clone()) {
            Ok(()) => {
                in_flight.insert(key, waiter.into_iter().collect());
                Ok(())
            }
            Err(TrySendError::Full(_)) => Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("resolving {host}: {MAX_QUEUED_LOOKUPS} lookups already waiting"),
            )),
            Err(TrySendError::Disconnected(_)) => {
                Err(io::Error::other("the resolver threads have stopped"))
            }
        }
    }
}

/// The addresses of `host:port`, without blocking the calling core (see
/// the module docs). An IP literal (IPv6 without brackets) is returned as
/// is.
pub async fn resolve(host: &str, port: u16) -> io::Result<Arc<[SocketAddr]>> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(Arc::from([SocketAddr::new(ip, port)].as_slice()));
    }
    let resolver = resolver()?;
    let cached = resolver
        .cache
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .lookup(host, port, clock::now());
    match cached {
        Lookup::Fresh(addrs) => Ok(addrs),
        Lookup::Stale(addrs) => {
            if let Err(e) = resolver.submit(host, port, None) {
                tracing::debug!(host, error = %e, "background refresh of a name not queued");
            }
            Ok(addrs)
        }
        Lookup::Failed(kind, message) => Err(io::Error::new(kind, message)),
        Lookup::Missing => {
            let slot = SharedSlot::default();
            resolver.submit(host, port, Some(slot.clone()))?;
            Answer(slot).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(list: &[&str]) -> Vec<SocketAddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[test]
    fn answers_are_fresh_then_stale_then_gone() {
        let t0 = clock::now();
        let mut cache = Cache::default();
        assert_eq!(cache.lookup("gpu-1", 8000, t0), Lookup::Missing);
        cache.record("gpu-1", 8000, &Ok(addrs(&["10.0.0.5:8000"])), t0);
        let expected: Arc<[SocketAddr]> = Arc::from(addrs(&["10.0.0.5:8000"]).as_slice());
        assert_eq!(
            cache.lookup("gpu-1", 8000, t0 + FRESH_FOR - Duration::from_millis(1)),
            Lookup::Fresh(expected.clone())
        );
        assert_eq!(
            cache.lookup("gpu-1", 8000, t0 + FRESH_FOR),
            Lookup::Stale(expected.clone())
        );
        assert_eq!(cache.lookup("gpu-1", 8000, t0 + STALE_FOR), Lookup::Missing);
        // The port is part of the key.
        assert_eq!(cache.lookup("gpu-1", 8001, t0), Lookup::Missing);
    }

    #[test]
    fn a_failure_is_remembered_briefly_and_never_replaces_a_good_answer() {
        let t0 = clock::now();
        let mut cache = Cache::default();
        let failure = Err(io::Error::new(io::ErrorKind::NotFound, "no such host"));
        cache.record("missing", 443, &failure, t0);
        assert_eq!(
            cache.lookup("missing", 443, t0 + NEGATIVE_FOR - Duration::from_millis(1)),
            Lookup::Failed(io::ErrorKind::NotFound, "no such host".into())
        );
        assert_eq!(
            cache.lookup("missing", 443, t0 + NEGATIVE_FOR),
            Lookup::Missing
        );
        cache.record("api", 443, &Ok(addrs(&["192.0.2.1:443"])), t0);
        cache.record("api", 443, &failure, t0 + FRESH_FOR);
        assert_eq!(
            cache.lookup("api", 443, t0 + FRESH_FOR),
            Lookup::Stale(Arc::from(addrs(&["192.0.2.1:443"]).as_slice()))
        );
    }

    #[test]
    fn the_cache_is_bounded_and_evicts_the_oldest_name() {
        let t0 = clock::now();
        let mut cache = Cache::default();
        for i in 0..MAX_CACHED_NAMES {
            let at = t0 + Duration::from_millis(i as u64);
            cache.record(&format!("h{i}"), 80, &Ok(addrs(&["127.0.0.1:80"])), at);
        }
        assert_eq!(cache.len(), MAX_CACHED_NAMES);
        let later = t0 + Duration::from_secs(1);
        cache.record("new", 80, &Ok(addrs(&["127.0.0.1:80"])), later);
        assert_eq!(cache.len(), MAX_CACHED_NAMES);
        assert_eq!(cache.lookup("h0", 80, later), Lookup::Missing);
        assert!(matches!(cache.lookup("h1", 80, later), Lookup::Fresh(_)));
        assert!(matches!(cache.lookup("new", 80, later), Lookup::Fresh(_)));
    }

    #[monoio::test_all]
    async fn ip_literals_need_no_lookup() {
        let v4 = resolve("127.0.0.1", 8000).await.unwrap();
        assert_eq!(&*v4, addrs(&["127.0.0.1:8000"]).as_slice());
        let v6 = resolve("::1", 443).await.unwrap();
        assert_eq!(&*v6, addrs(&["[::1]:443"]).as_slice());
    }

    // `localhost` resolves from /etc/hosts on every Linux machine, so this
    // exercises the resolver thread and its cross-thread wake for real.
    #[monoio::test_all(timer_enabled = true)]
    async fn names_are_resolved_on_a_resolver_thread_and_cached() {
        let caller = std::thread::current().id();
        let resolved = resolve("localhost", 8443).await.unwrap();
        assert!(!resolved.is_empty());
        assert!(resolved
            .iter()
            .all(|a| a.port() == 8443 && a.ip().is_loopback()));
        assert_eq!(std::thread::current().id(), caller);
        let cached =
            resolver()
                .unwrap()
                .cache
                .lock()
                .unwrap()
                .lookup("localhost", 8443, clock::now());
        assert_eq!(cached, Lookup::Fresh(resolved));
    }
}
