//! What a connection may cost before it has said who it is: its request head is cut at
//! [`HEAD_LIMIT`], and one client address holds at most its share of the instance's
//! connections ([`AddressSlots`]), so a stranger with one address can neither exhaust memory
//! nor keep other clients out.
//!
//! Invariants: a slot is given back exactly once, when the connection's task ends (the
//! [`AddressSlot`] guard); an address with no connection has no entry, so the table holds
//! at most one entry per open connection. IPv6 clients are counted per /64 (one customer's
//! usual allocation), an IPv4-mapped address as its IPv4 address.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use ipnet::IpNet;

/// Bytes a request head (request line and headers) may take; past it 431 and the connection
/// closes. Browsers send a few KB; a JWT in a header or cookie is 1–4 KB.
pub(crate) const HEAD_LIMIT: usize = 32 * 1024;

/// Resident memory one open connection can cost at most, for the memory budget: hyper's
/// read and write buffers (each capped at [`HEAD_LIMIT`]), TLS records in and out, the
/// task and the socket. Measured: see docs/deployment.md, "Internet exposure".
pub(crate) const CONNECTION_COST: u64 = 112 * 1024;

/// Written to a connection over its address's share before closing it.
pub(crate) const OVER_SHARE: &[u8] = b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 5\r\nconnection: close\r\ncontent-length: 63\r\n\r\n{\"error\":\"too many connections from your address; retry later\"}";

/// Open connections per client address, each address up to `max`.
#[derive(Debug)]
pub(crate) struct AddressSlots {
    max: usize,
    /// Addresses not counted: proxies that carry many clients (`--trusted-proxy`).
    trusted: Vec<IpNet>,
    held: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's place in its address's share; given back when dropped.
#[derive(Debug)]
pub(crate) struct AddressSlot {
    slots: Arc<AddressSlots>,
    /// `None`: a trusted proxy's, not counted.
    key: Option<IpAddr>,
}

impl AddressSlots {
    pub(crate) fn new(max: usize, trusted: impl IntoIterator<Item = IpNet>) -> Self {
        Self {
            max,
            trusted: trusted.into_iter().collect(),
            held: Mutex::default(),
        }
    }

    /// A place for a connection from `peer`, or `None` when its address holds its share.
    pub(crate) fn take(self: &Arc<Self>, peer: IpAddr) -> Option<AddressSlot> {
        let Some(key) = self.client(peer) else {
            return Some(AddressSlot {
                slots: self.clone(),
                key: None,
            });
        };
        let mut held = self.held.lock().expect("address slots poisoned");
        let n = held.entry(key).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(AddressSlot {
            slots: self.clone(),
            key: Some(key),
        })
    }

    /// The key `peer`'s failures and share are counted under; `None` for a trusted proxy
    /// (it carries many clients: the proxy enforces their shares).
    pub(crate) fn client(&self, peer: IpAddr) -> Option<IpAddr> {
        let peer = canonical(peer);
        let trusted = self.trusted.iter().any(|net| net.contains(&peer));
        (!trusted).then(|| counted_as(peer))
    }

    /// Client addresses holding a connection now.
    pub(crate) fn addresses(&self) -> usize {
        self.held.lock().expect("address slots poisoned").len()
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let Some(key) = self.key else { return };
        let mut held = self.slots.held.lock().expect("address slots poisoned");
        if let Some(n) = held.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                held.remove(&key);
            }
        }
    }
}

/// An IPv4-mapped IPv6 address as its IPv4 address.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The unit a share is counted in: an IPv4 address, or an IPv6 /64.
fn counted_as(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn an_address_holds_its_share_and_gets_it_back() {
        let slots = Arc::new(AddressSlots::new(2, []));
        let a = slots.take(ip("10.0.0.1")).unwrap();
        let _b = slots.take(ip("10.0.0.1")).unwrap();
        assert!(slots.take(ip("10.0.0.1")).is_none(), "over its share");
        assert!(
            slots.take(ip("10.0.0.2")).is_some(),
            "another address is not affected"
        );
        drop(a);
        assert!(
            slots.take(ip("10.0.0.1")).is_some(),
            "a closed connection frees its place"
        );
    }

    #[test]
    fn an_address_without_connections_leaves_no_entry() {
        let slots = Arc::new(AddressSlots::new(2, []));
        let held: Vec<_> = (0..50)
            .map(|i| slots.take(IpAddr::from([10, 0, 0, i])).unwrap())
            .collect();
        assert_eq!(slots.addresses(), 50);
        drop(held);
        assert_eq!(slots.addresses(), 0);
    }

    #[test]
    fn ipv6_counts_per_64_and_mapped_ipv4_as_ipv4() {
        let slots = Arc::new(AddressSlots::new(1, []));
        let _a = slots.take(ip("2001:db8:1:2::1")).unwrap();
        assert!(slots.take(ip("2001:db8:1:2::ffff")).is_none(), "same /64");
        assert!(slots.take(ip("2001:db8:1:3::1")).is_some(), "another /64");
        let _v4 = slots.take(ip("192.0.2.7")).unwrap();
        assert!(
            slots.take(ip("::ffff:192.0.2.7")).is_none(),
            "the same IPv4 client"
        );
    }

    #[test]
    fn a_trusted_proxy_is_not_counted() {
        let slots = Arc::new(AddressSlots::new(1, ["10.1.0.0/16".parse().unwrap()]));
        let held: Vec<_> = (0..10)
            .map(|_| slots.take(ip("10.1.1.1")).unwrap())
            .collect();
        assert_eq!(slots.addresses(), 0);
        assert!(
            slots.take(ip("::ffff:10.1.1.1")).is_some(),
            "mapped form too"
        );
        drop(held);
    }

    #[test]
    fn the_over_share_answer_says_its_length() {
        let text = std::str::from_utf8(OVER_SHARE).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())));
        assert!(serde_json::from_str::<serde_json::Value>(body).is_ok());
    }
}
