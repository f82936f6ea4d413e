//! A cap on what one peer address may hold at once (open connections,
//! handshakes in progress), for the whole process: every core's accept loop
//! asks the same [`PeerLimit`], so a peer whose connections the kernel
//! spreads over the cores (`SO_REUSEPORT`) still counts once.
//!
//! The key is the peer's address, IPv4-mapped IPv6 addresses as their IPv4
//! address, and an IPv6 address by its `/64` prefix: one host on IPv6
//! usually holds a whole `/64`, so counting single addresses would let it
//! take as many places as it likes.
//!
//! The table holds only peers with places in use (an entry goes when its
//! last place is given back), so it is bounded by the listener's own
//! connection cap. One mutex for the process: taken once per accept and
//! once per close, never across an await.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex, PoisonError};

/// The key a peer address counts under (see the module docs).
pub fn peer_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(prefix))
        }
    }
}

/// Places in use per peer, at most `limit` each; see the module docs.
#[derive(Debug)]
pub struct PeerLimit {
    limit: usize,
    in_use: Mutex<HashMap<IpAddr, usize>>,
}

impl PeerLimit {
    /// A table letting each peer hold `limit` places (at least one).
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit: limit.max(1),
            in_use: Mutex::new(HashMap::new()),
        })
    }

    /// The cap per peer.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// A place for `ip`, or `None` when its peer holds `limit` already.
    pub fn try_enter(self: &Arc<Self>, ip: IpAddr) -> Option<PeerPermit> {
        let key = peer_key(ip);
        let mut in_use = self.in_use.lock().unwrap_or_else(PoisonError::into_inner);
        let held = in_use.entry(key).or_insert(0);
        if *held >= self.limit {
            return None;
        }
        *held += 1;
        Some(PeerPermit {
            table: Arc::clone(self),
            key,
        })
    }

    /// Places `ip`'s peer holds now.
    pub fn held_by(&self, ip: IpAddr) -> usize {
        let in_use = self.in_use.lock().unwrap_or_else(PoisonError::into_inner);
        in_use.get(&peer_key(ip)).copied().unwrap_or(0)
    }

    /// Peers holding at least one place.
    pub fn peers(&self) -> usize {
        self.in_use
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// One place of one peer in a [`PeerLimit`]; dropping it gives it back.
pub struct PeerPermit {
    table: Arc<PeerLimit>,
    key: IpAddr,
}

impl std::fmt::Debug for PeerPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerPermit")
            .field("peer", &self.key)
            .finish()
    }
}

impl Drop for PeerPermit {
    fn drop(&mut self) {
        let mut in_use = self
            .table
            .in_use
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = in_use.get_mut(&self.key) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                in_use.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn each_peer_holds_at_most_the_limit_and_gets_places_back() {
        let limit = PeerLimit::new(2);
        let a1 = limit.try_enter(ip("10.0.0.1")).unwrap();
        let _a2 = limit.try_enter(ip("10.0.0.1")).unwrap();
        assert!(limit.try_enter(ip("10.0.0.1")).is_none());
        // Another peer is not affected.
        let _b = limit.try_enter(ip("10.0.0.2")).unwrap();
        assert_eq!(limit.held_by(ip("10.0.0.1")), 2);
        drop(a1);
        assert_eq!(limit.held_by(ip("10.0.0.1")), 1);
        let _a3 = limit.try_enter(ip("10.0.0.1")).unwrap();
        assert_eq!(limit.peers(), 2);
    }

    #[test]
    fn the_table_forgets_a_peer_with_no_places() {
        let limit = PeerLimit::new(1);
        drop(limit.try_enter(ip("10.0.0.1")).unwrap());
        assert_eq!(limit.peers(), 0);
    }

    #[test]
    fn mapped_ipv4_counts_as_ipv4_and_ipv6_counts_by_its_64_prefix() {
        let limit = PeerLimit::new(1);
        let _v4 = limit.try_enter(ip("192.0.2.7")).unwrap();
        assert!(limit.try_enter(ip("::ffff:192.0.2.7")).is_none());
        let _v6 = limit.try_enter(ip("2001:db8:1:2::1")).unwrap();
        assert!(limit.try_enter(ip("2001:db8:1:2:ffff::9")).is_none());
        assert!(limit.try_enter(ip("2001:db8:1:3::1")).is_some());
        assert_eq!(peer_key(ip("2001:db8:1:2:aa::1")), ip("2001:db8:1:2::"));
    }
}
