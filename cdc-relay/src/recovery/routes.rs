//! The routes a routed relay's session loads (see `sink::layout`): the registry's, the outbox
//! table's and the message prefixes', each with where it was first seen.
//!
//! The registry (a hash beside the streams: route → LSN) says, for a route a row or a prefix
//! made, the WAL position it was first seen at (the commit LSN of the row that named it, or
//! the server's position when a new prefix, or the fallback route, was loaded); `0` for a
//! route found in the table and not registered, whose rows may predate the slot's position
//! (Redis lost the registry), or may not (rows of new routes that came while the session
//! started again): such a route is caught up from the table, which is always sound.
//!
//! Invariants: a route is registered before any entry of it is acknowledged (a new route is
//! registered before its session ends, and its first entries go only through the next
//! session), and first-seen positions are never lowered below the truth (`HSETNX`); a route
//! whose rows the table still holds is loaded whenever Redis may have lost the registry (the
//! anchor's record, beside it, is missing or behind the slot, or the registry lacks the
//! fallback route every session registers, last, before anything is acknowledged), its
//! lanes then without a record and caught up from the table; more routes than
//! `--max-routes` stop the relay saying so, never drop a row.

use std::collections::HashMap;

use redis::AsyncCommands;
use tokio_postgres::Client;
use tracing::{info, warn};

use crate::context::Context;
use crate::error::RelayError;
use crate::sink::layout::{anchor_stream, registry_key, route_name, valid_route, FALLBACK_ROUTE};
use crate::sink::{Publisher, Records};
use crate::source::slot_info;

/// A session's routes, each with the WAL position it was first seen at (`0`: unknown, or
/// found in the table).
pub(crate) type Routes = HashMap<String, u64>;

/// Every route the session must have: the registry's, those of rows the outbox table holds
/// (NULL and invalid values as the fallback route) and the message prefixes; the new ones
/// registered.
pub(crate) async fn load(
    ctx: &Context,
    sql: &Client,
    publisher: &Publisher,
) -> Result<Routes, RelayError> {
    let cfg = &ctx.config;
    let key = registry_key(&cfg.stream, cfg.stream_shards);
    let mut conn = publisher.connection();
    let registered: HashMap<String, String> =
        tokio::time::timeout(cfg.redis_timeout, conn.hgetall(&key))
            .await
            .map_err(|_| RelayError::ShardUnreachable {
                stream: key.clone(),
            })??;
    // Every session registers the fallback route before anything is acknowledged: a registry
    // without it was deleted or evicted (its anchor record may have survived), and says
    // nothing about which routes hold acknowledged rows.
    let registry_whole = registered.contains_key(FALLBACK_ROUTE);
    let mut routes: Routes = registered
        .into_iter()
        .filter(|(r, _)| valid_route(r))
        .map(|(r, at)| (r, at.parse().unwrap_or(0)))
        .collect();
    let mapping = &cfg.postgres.outbox;
    let column = mapping.route.as_ref().ok_or_else(|| {
        RelayError::Config("a routed --stream needs --outbox-route-column".into())
    })?;
    // Every route the table still holds rows of, when Redis may have lost routes it had
    // acknowledged: these are the streams to rebuild. Not while the anchor's record (beside
    // the registry) holds what the slot was told: then every route with an acknowledged row
    // is registered, and the scan of the table is spared.
    let rows = if registry_whole && registry_current(ctx, sql, publisher).await? {
        Vec::new()
    } else {
        sql.query(
            &format!(
                "SELECT DISTINCT {column} FROM {table} o",
                column = column.as_sent("o"),
                table = format_args!("\"{}\".\"{}\"", mapping.table.schema, mapping.table.table),
            ),
            &[],
        )
        .await?
    };
    let fallback = FALLBACK_ROUTE.to_string();
    let mut new: Vec<(String, u64)> = Vec::new();
    for row in &rows {
        let route = route_name(row.get::<_, Option<&str>>(0).map(str::as_bytes)).to_string();
        if !routes.contains_key(&route) {
            routes.insert(route.clone(), 0);
            new.push((route, 0));
        }
    }
    // A prefix never loaded before has published nothing, nor has the fallback route when
    // the table holds none of its rows: first seen here, at the server's position (past the
    // slot's).
    let here_routes: Vec<&String> = cfg
        .message_prefixes
        .iter()
        .chain(std::iter::once(&fallback))
        .filter(|r| !routes.contains_key(*r))
        .collect();
    if !here_routes.is_empty() {
        // A standby has no current WAL position of its own: its replay position.
        let here: String = sql
            .query_one(
                "SELECT coalesce(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                                      ELSE pg_current_wal_lsn() END, '0/0')::text",
                &[],
            )
            .await?
            .get(0);
        let here = pgwire_replication::Lsn::parse(&here)
            .map_err(|e| RelayError::Protocol(format!("pg_current_wal_lsn: {}", e.0)))?
            .as_u64();
        for route in here_routes {
            routes.insert(route.clone(), here);
            new.push((route.clone(), here));
        }
    }
    if routes.len() > cfg.max_routes as usize {
        let mut names: Vec<&String> = routes.keys().collect();
        names.sort();
        return Err(RelayError::Config(format!(
            "the outbox has {} routes ({}, …) but --max-routes is {}: raise --max-routes (each route is --stream-shards streams and lanes)",
            routes.len(),
            names.iter().take(5).map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
            cfg.max_routes
        )));
    }
    if !new.is_empty() {
        let new = in_registration_order(new);
        for (route, at) in &new {
            register(ctx, publisher, route, *at).await?;
        }
        info!(routes = ?new, "routes registered");
    }
    Ok(routes)
}

/// The fallback route last: a registry holding it is trusted whole (when the anchor is
/// current), so it must appear only once every route of the same scan is in. A session
/// ended between two registrations then leaves a registry the next session does not trust,
/// and scans the table again, instead of one missing a route whose acknowledged rows it
/// would never catch up.
fn in_registration_order(mut new: Vec<(String, u64)>) -> Vec<(String, u64)> {
    // Stable: the others keep their order.
    new.sort_by_key(|(route, _)| route == FALLBACK_ROUTE);
    new
}

/// Whether the registry (which holds the fallback route: it was not deleted or evicted on its
/// own) holds every route an acknowledged row named: the anchor lane's
/// record (on the registry's node, written with every acknowledgement to all lanes, and
/// whose route every session has) exists and holds at least the slot's position. A Redis
/// that lost data, or came back from an older copy, shows it there first.
async fn registry_current(
    ctx: &Context,
    sql: &Client,
    publisher: &Publisher,
) -> Result<bool, RelayError> {
    let cfg = &ctx.config;
    let Some(confirmed) = slot_info(sql, &cfg.postgres.slot)
        .await?
        .filter(|s| !s.is_lost())
        .and_then(|s| s.confirmed_flush_lsn)
    else {
        return Ok(false);
    };
    let mut anchor = Records::new(
        publisher.connection(),
        &anchor_stream(&cfg.stream, cfg.stream_shards),
    );
    let record = tokio::time::timeout(cfg.redis_timeout, anchor.read())
        .await
        .map_err(|_| RelayError::ShardUnreachable {
            stream: anchor_stream(&cfg.stream, cfg.stream_shards),
        })??;
    Ok(record.exists()
        && record.rebuilding.is_none()
        && !record.lost_entries()
        && record
            .acked_through
            .is_some_and(|acked| acked >= confirmed.as_u64()))
}

/// Register `route`, first seen at `at` (kept if it was registered before).
pub(crate) async fn register(
    ctx: &Context,
    publisher: &Publisher,
    route: &str,
    at: u64,
) -> Result<(), RelayError> {
    let key = registry_key(&ctx.config.stream, ctx.config.stream_shards);
    let mut conn = publisher.connection();
    match tokio::time::timeout(
        ctx.config.redis_timeout,
        conn.hset_nx::<_, _, _, i64>(&key, route, at),
    )
    .await
    {
        Ok(added) => {
            added?;
            Ok(())
        }
        Err(_) => {
            warn!(%key, "the route registry did not answer in time");
            Err(RelayError::ShardUnreachable { stream: key })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_route_is_registered_after_every_other() {
        let new = vec![
            ("order".to_string(), 0),
            (FALLBACK_ROUTE.to_string(), 0),
            ("customer".to_string(), 0),
            ("prefix".to_string(), 7),
        ];
        let order: Vec<String> = in_registration_order(new)
            .into_iter()
            .map(|(r, _)| r)
            .collect();
        assert_eq!(order, ["order", "customer", "prefix", FALLBACK_ROUTE]);
    }
}
