//! Where a row goes: the streams of one session and the lane each row takes.
//!
//! Unrouted (the chat's), one stream of N shards. Routed (`--stream` holds
//! `${routedByValue}`, Debezium's `route.topic.replacement`), one stream of N shards per
//! route, the route being the row's route column value (or a message's prefix), so that
//! `outbox.event.${routedByValue}` sends `Order` rows to `outbox.event.Order`. A lane is one
//! shard of one route's stream, numbered `route index × N + shard`: everything per shard (its
//! record, writer epoch, fence, catch-up, back-pressure) is per lane, unchanged.
//!
//! Invariants:
//! - a session's routes are fixed when it takes the slot over; a row of a route it does not
//!   have ends the session before anything of that transaction is acknowledged (after
//!   registering the route), and the next session loads it: a new route's lanes have no
//!   record, so they start behind and are caught up from the table like any such shard;
//! - a session loads every route the registry names and every route the outbox table still
//!   holds rows of, so a Redis that lost the registry with its streams rebuilds them all;
//! - a route's name is checked before it becomes part of a key (letters, digits, `.`, `_`,
//!   `-`; no hash-tag braces, no separators): a NULL or other value goes to the route
//!   [`FALLBACK_ROUTE`], counted and said, never dropped and never stopping the relay;
//! - every route's shard `k` carries the `{k}` hash tag, so on a cluster the lanes of one
//!   shard number share a node and a connection.

use std::collections::HashMap;
use std::sync::Arc;

use outbox_core::stream::{shard_key, shard_of};

/// What a stream name holds where the route goes (Debezium's placeholder).
pub(crate) const PLACEHOLDER: &str = "${routedByValue}";
/// The route of a row whose route value is NULL or not a valid name.
pub(crate) const FALLBACK_ROUTE: &str = "unrouted";
/// The longest route name.
pub(crate) const MAX_ROUTE_LEN: usize = 100;
/// Where, in the template, the registry of routes is kept (in place of the route).
const REGISTRY_ROUTE: &str = "_routes";

/// Whether `name` may be a route (and so part of a stream key): 1–100 ASCII letters, digits,
/// `.`, `_` and `-`, starting with a letter or digit (so it cannot be the registry's).
pub(crate) fn valid_route(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_ROUTE_LEN
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// The route a row's value names: itself when valid, else [`FALLBACK_ROUTE`]. Trailing
/// spaces are not part of it: a `char(n)` column sends its value padded.
pub(crate) fn route_name(value: Option<&[u8]>) -> &str {
    value
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(|v| v.trim_end_matches(' '))
        .filter(|v| valid_route(v))
        .unwrap_or(FALLBACK_ROUTE)
}

/// Whether the stream name is a template with a route placeholder.
pub(crate) fn is_routed(stream: &str) -> bool {
    stream.contains(PLACEHOLDER)
}

/// The stream of `route` under `template`.
pub(crate) fn route_stream(template: &str, route: &str) -> String {
    template.replace(PLACEHOLDER, route)
}

/// The registry of the routes a routed stream has (a hash), kept beside the fallback route's
/// first shard: with more than one shard it carries the `{0}` hash tag, so on a cluster it
/// lives on the node of the anchor's record (see [`Layout::anchor`]), and the record being
/// current says the registry is.
pub(crate) fn registry_key(template: &str, shards: u32) -> String {
    shard_key(&route_stream(template, REGISTRY_ROUTE), 0, shards)
}

/// The stream key of the anchor lane of a routed stream (the fallback route's first shard).
pub(crate) fn anchor_stream(template: &str, shards: u32) -> String {
    shard_key(&route_stream(template, FALLBACK_ROUTE), 0, shards)
}

/// The streams of one session: its routes (one, unnamed, when unrouted) and shards per stream.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    template: Arc<str>,
    routed: bool,
    shards: u32,
    routes: Arc<[String]>,
    index: Arc<HashMap<String, u32>>,
}

/// A row whose route the session does not have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NewRoute(pub String);

impl Layout {
    /// `stream` of `shards` shards: one stream when unrouted; routed, the given routes
    /// (sorted, each once; invalid names are left out).
    pub(crate) fn new(stream: &str, shards: u32, routes: impl IntoIterator<Item = String>) -> Self {
        let routed = is_routed(stream);
        let routes: Vec<String> = if routed {
            // The fallback route is always there: rows without a valid route have a stream,
            // and the rebuild lock a place that does not move as routes come.
            let mut routes: Vec<String> = routes
                .into_iter()
                .filter(|r| valid_route(r))
                .chain([FALLBACK_ROUTE.to_string()])
                .collect();
            routes.sort();
            routes.dedup();
            routes
        } else {
            vec![String::new()]
        };
        let index = routes
            .iter()
            .enumerate()
            .map(|(i, r)| (r.clone(), i as u32))
            .collect();
        Self {
            template: stream.into(),
            routed,
            shards,
            routes: routes.into(),
            index: Arc::new(index),
        }
    }

    pub(crate) fn is_routed(&self) -> bool {
        self.routed
    }

    /// The configured name (a template when routed).
    pub(crate) fn template(&self) -> &str {
        &self.template
    }

    /// The lane whose record the rebuild lock lives beside (and the relay's functions are
    /// checked on): shard 0 of the one stream, or of the fallback route's, which every
    /// session of a routed relay has whatever other routes it loaded.
    pub(crate) fn anchor(&self) -> u32 {
        self.index
            .get(FALLBACK_ROUTE)
            .map_or(0, |i| i * self.shards)
    }

    /// Shards of each route's stream.
    pub(crate) fn shards(&self) -> u32 {
        self.shards
    }

    /// The session's routes (`[""]` when unrouted).
    pub(crate) fn routes(&self) -> &[String] {
        &self.routes
    }

    /// Lanes in all: routes × shards.
    pub(crate) fn lanes(&self) -> u32 {
        self.routes.len() as u32 * self.shards
    }

    /// The lane of a row of route value `route` and key `key`; a route the session does not
    /// have is a [`NewRoute`].
    pub(crate) fn lane_of(
        &self,
        route: Option<&[u8]>,
        key: Option<&[u8]>,
    ) -> Result<u32, NewRoute> {
        let shard = shard_of(key, self.shards);
        if !self.routed {
            return Ok(shard);
        }
        let name = route_name(route);
        match self.index.get(name) {
            Some(i) => Ok(i * self.shards + shard),
            None => Err(NewRoute(name.to_string())),
        }
    }

    /// The route of `lane` (`""` when unrouted).
    pub(crate) fn route_of(&self, lane: u32) -> &str {
        &self.routes[(lane / self.shards) as usize]
    }

    /// The shard number of `lane` within its route's stream.
    pub(crate) fn shard_of_lane(&self, lane: u32) -> u32 {
        lane % self.shards
    }

    /// The stream (its configured name, before sharding) of `lane`'s route.
    pub(crate) fn base_of(&self, lane: u32) -> String {
        self.base(self.route_of(lane))
    }

    fn base(&self, route: &str) -> String {
        if self.routed {
            route_stream(&self.template, route)
        } else {
            self.template.to_string()
        }
    }

    /// Each route's stream name, in route order.
    pub(crate) fn bases(&self) -> Vec<String> {
        self.routes.iter().map(|r| self.base(r)).collect()
    }

    /// The stream key of every lane, in lane order.
    pub(crate) fn keys(&self) -> Vec<String> {
        (0..self.lanes())
            .map(|lane| shard_key(&self.base_of(lane), self.shard_of_lane(lane), self.shards))
            .collect()
    }

    /// How logs and metrics name `lane`: its shard number, after its route when routed
    /// (`Order/3`).
    pub(crate) fn label(&self, lane: u32) -> String {
        let shard = self.shard_of_lane(lane);
        if self.routed {
            format!("{}/{shard}", self.route_of(lane))
        } else {
            shard.to_string()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_padded_value_names_its_route_without_the_padding() {
        assert_eq!(route_name(Some(b"order       ")), "order");
        assert_eq!(route_name(Some(b"order")), "order");
        assert_eq!(route_name(Some(b"  order")), FALLBACK_ROUTE);
        assert_eq!(route_name(Some(b"            ")), FALLBACK_ROUTE);
        assert_eq!(route_name(None), FALLBACK_ROUTE);
    }

    #[test]
    fn unrouted_is_one_stream_of_shards() {
        let layout = Layout::new("outbox:consumers", 4, ["ignored".to_string()]);
        assert!(!layout.is_routed());
        assert_eq!(layout.lanes(), 4);
        assert_eq!(
            layout.lane_of(Some(b"x"), Some(b"chat-1")),
            Ok(shard_of(Some(b"chat-1"), 4))
        );
        assert_eq!(
            layout.keys(),
            [
                "outbox:consumers:{0}",
                "outbox:consumers:{1}",
                "outbox:consumers:{2}",
                "outbox:consumers:{3}"
            ]
        );
        assert_eq!(layout.label(2), "2");
    }

    #[test]
    fn routed_lanes_are_route_then_shard() {
        let routes = ["Order", "Customer", "Order", "bad{tag}"].map(String::from);
        let layout = Layout::new("outbox.event.${routedByValue}", 2, routes);
        assert_eq!(layout.routes(), ["Customer", "Order", FALLBACK_ROUTE]);
        assert_eq!(layout.lanes(), 6);
        assert_eq!(layout.anchor(), 4);
        let shard = shard_of(Some(b"42"), 2);
        assert_eq!(layout.lane_of(Some(b"Order"), Some(b"42")), Ok(2 + shard));
        assert_eq!(
            layout.lane_of(Some(b"Invoice"), Some(b"42")),
            Err(NewRoute("Invoice".into()))
        );
        // NULL and names that cannot be keys go to the fallback route.
        for bad in [
            None,
            Some(&b"a{b}"[..]),
            Some(b""),
            Some(b"_routes"),
            Some(b"\xff"),
        ] {
            assert_eq!(layout.lane_of(bad, None), Ok(4));
        }
        assert_eq!(
            layout.keys(),
            [
                "outbox.event.Customer:{0}",
                "outbox.event.Customer:{1}",
                "outbox.event.Order:{0}",
                "outbox.event.Order:{1}",
                "outbox.event.unrouted:{0}",
                "outbox.event.unrouted:{1}"
            ]
        );
        assert_eq!(layout.base_of(3), "outbox.event.Order");
        assert_eq!(layout.label(3), "Order/1");
        assert_eq!(
            registry_key(layout.template(), 2),
            "outbox.event._routes:{0}"
        );
        assert_eq!(registry_key(layout.template(), 1), "outbox.event._routes");
        assert_eq!(
            anchor_stream(layout.template(), 2),
            layout.keys()[layout.anchor() as usize]
        );
        assert!(valid_route(&"a".repeat(MAX_ROUTE_LEN)));
        assert!(!valid_route(&"a".repeat(MAX_ROUTE_LEN + 1)));
    }
}
