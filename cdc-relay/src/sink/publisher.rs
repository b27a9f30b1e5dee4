//! Publishing into the Redis stream: one script call per part (a shard's share of one or
//! more sealed batches), idempotent by id.
//!
//! A stream of N shards (see `shard`) is N streams, each with its own record. A part
//! records its acknowledgement (and, when the acknowledgement covers one, a watermark) in its
//! shard's record; the session acknowledges the slot only as far as every live shard
//! recorded.
//!
//! The script (`publish.lua`) writes a whole part atomically, skips entries Redis already
//! has (replays after a reconnect carry the same ids), refuses a stream without its record
//! (Redis lost it), another cluster's stream (origin guard) or another timeline, refuses to
//! continue after the stream lost entries this session wrote (fence), refuses a part that
//! would pass --stream-max-len unread entries (the shard falls behind instead: nothing unread
//! is ever trimmed), and trims only what every consumer group acknowledged. A failed or
//! timed-out call is simply sent again: it cannot write anything twice.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::Lsn;
use redis::{ErrorKind, Value};

use outbox_core::connect::{RedisConn, RedisTarget};
use outbox_core::stream::keys::origin_key;
use outbox_core::stream::record::check_layout;
use outbox_core::stream::{entry, EntryId};

use super::batch::StreamEntry;
use super::functions::{MAKE_ROOM, PUBLISH, READY};
use super::layout::Layout;
use super::record::{Records, StreamRecord};
use crate::decode::OutboxEvent;
use crate::error::{script_codes, RelayError};
use crate::source::{Origin, Watermark};
use outbox_core::functions;

/// The publish script, after the helpers it shares with [`ROOM`].
pub(super) const SCRIPT: &str = concat!(include_str!("trim.lua"), include_str!("publish.lua"));
/// Making room for a catch-up's entries (see `room.lua`).
pub(super) const ROOM: &str = concat!(include_str!("trim.lua"), include_str!("room.lua"));

/// What one call did to the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct PublishOutcome {
    pub published: u64,
    /// Entries Redis already had (replays), counted, not written.
    pub duplicates: u64,
    /// Every consumer group acknowledged everything below this id (read when the call
    /// wrote entries and the shard has groups).
    pub acked_below: Option<EntryId>,
}

/// What a part records in its shard's record besides its entries.
#[derive(Debug, Clone, Default)]
pub(crate) struct PartMeta {
    /// Recorded as `acked_through` (the slot is acknowledged there once every live shard has).
    pub(crate) ack_lsn: Option<Lsn>,
    /// The last id sealed into the shard before this part: the stream must hold it.
    pub(crate) fence: Option<EntryId>,
    /// A watermark `ack_lsn` covers, recorded with it.
    pub(crate) watermark: Option<Arc<Watermark>>,
    /// A catch-up's last call: its marker goes.
    pub(crate) rejoin: bool,
    /// A catch-up's progress with this call (`<snapshot>/<outbox id>`).
    pub(crate) cursor: Option<String>,
    /// A snapshot every row of which is in the shard now (a catch-up's finished round).
    pub(crate) done: Option<String>,
}

/// The keys of one shard.
#[derive(Debug, Clone)]
struct ShardKeys {
    stream: String,
    origin_key: String,
}

/// The keys of every lane of `layout`, in lane order.
fn lane_keys(layout: &Layout) -> Arc<[ShardKeys]> {
    layout
        .keys()
        .into_iter()
        .map(|stream| ShardKeys {
            origin_key: origin_key(&stream),
            stream,
        })
        .collect()
}

/// The Redis connection every clone of a publisher shares, made anew when it stops finding
/// its nodes: a cluster connection can be left with none after every node restarted, and
/// waits out its own reconnection schedule (seconds) while a new one connects at once.
#[derive(Clone)]
struct SharedConn {
    current: Arc<std::sync::Mutex<RedisConn>>,
    target: RedisTarget,
    timeout: Duration,
    renewed_at: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

impl SharedConn {
    fn new(conn: RedisConn, target: &RedisTarget, timeout: Duration) -> Self {
        Self {
            current: Arc::new(std::sync::Mutex::new(conn)),
            target: target.clone(),
            timeout,
            renewed_at: Arc::default(),
        }
    }

    fn get(&self) -> RedisConn {
        self.current.lock().unwrap().clone()
    }

    /// After `e`: when it says the connection has no way to its node, connect anew and
    /// replace the shared connection (at most once a second: every lane meets the same
    /// error at once). The caller sends again on the new one.
    async fn renew_if_lost(&self, e: &RelayError) {
        if !lost_its_nodes(e) {
            return;
        }
        {
            let mut at = self.renewed_at.lock().unwrap();
            if at.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
                return;
            }
            *at = Some(std::time::Instant::now());
        }
        match tokio::time::timeout(self.timeout, self.target.connect(self.timeout)).await {
            Ok(Ok(conn)) => {
                *self.current.lock().unwrap() = conn;
                tracing::info!("replaced the Redis connection, which found none of its nodes");
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "a new Redis connection failed too"),
            Err(_) => tracing::debug!("a new Redis connection did not answer in time"),
        }
    }
}

/// Whether `e` says the connection has no way to its node (as opposed to a node's answer).
fn lost_its_nodes(e: &RelayError) -> bool {
    match e {
        RelayError::Redis(e) => {
            e.kind() == ErrorKind::ClusterConnectionNotFound
                || e.is_connection_dropped()
                || e.is_connection_refusal()
        }
        _ => false,
    }
}

#[derive(Clone)]
pub(crate) struct Publisher {
    /// For what concerns the whole stream (its layout).
    conn: SharedConn,
    /// Each shard's own (on a cluster; one shared on a single server). redis-rs sends
    /// nothing on a cluster connection while it refreshes its slot map, and a request that
    /// times out on a frozen node starts the next refresh (which waits for that node): on
    /// one shared connection, one frozen host would time out every shard's calls.
    shard_conns: Arc<[SharedConn]>,
    /// The session's streams: its routes and shards (lanes).
    layout: Layout,
    /// Each lane's keys, in lane order (see [`Layout`]); "shard" below means a lane.
    shards: Arc<[ShardKeys]>,
    max_len: u64,
    /// Replicas that must acknowledge each call before it counts (`WAIT`), and how long
    /// to wait for them.
    wait_replicas: u32,
    timeout: Duration,
    /// This session's writer epoch per shard (see the record): the script refuses it once
    /// a newer session claimed the shard. Shared by the session's clones: a catch-up claims
    /// a shard it reaches late, and the live lane then writes with that claim.
    writer_epochs: Arc<[AtomicU64]>,
    /// Added to commit LSNs to make stream ids (a watermark's `lo` becomes an id with it).
    id_offset: u64,
}

impl Publisher {
    /// Connect (one attempt; the caller retries) and load the script.
    pub(crate) async fn connect(
        target: &RedisTarget,
        stream: &str,
        shards: u32,
        max_len: u64,
        response_timeout: Duration,
    ) -> Result<Self, RelayError> {
        let own = if target.is_cluster() && shards > 1 {
            shards as usize
        } else {
            0
        };
        // All at once: each waits for any node that does not answer.
        let (conn, made) = futures::future::join(
            target.connect(response_timeout),
            futures::future::join_all((0..own).map(|_| target.connect(response_timeout))),
        )
        .await;
        let conn = conn?;
        let conn = SharedConn::new(conn, target, response_timeout);
        let shard_conns: Arc<[SharedConn]> = if own > 0 {
            made.into_iter()
                .map(|c| match c {
                    Ok(c) => SharedConn::new(c, target, response_timeout),
                    // Renewed once it finds no node; meanwhile the stream's own.
                    Err(_) => conn.clone(),
                })
                .collect()
        } else {
            (0..shards).map(|_| conn.clone()).collect()
        };
        let layout = Layout::new(stream, shards, []);
        let shards = lane_keys(&layout);
        let writer_epochs = (0..shards.len()).map(|_| AtomicU64::new(0)).collect();
        Ok(Self {
            conn,
            shard_conns,
            layout,
            shards,
            max_len,
            wait_replicas: 0,
            timeout: response_timeout,
            writer_epochs,
            id_offset: 0,
        })
    }

    /// Count a call as confirmed only once `replicas` replicas of its node acknowledged it
    /// (`WAIT`): a failover then cannot lose what the slot was told was delivered.
    pub(crate) fn with_wait_replicas(mut self, replicas: u32) -> Self {
        self.wait_replicas = replicas;
        self
    }

    /// The same connections writing `layout`'s lanes (a session's routes), with no epochs
    /// claimed yet.
    pub(crate) fn with_layout(&self, layout: Layout) -> Self {
        let mut publisher = self.clone();
        publisher.shards = lane_keys(&layout);
        publisher.writer_epochs = (0..publisher.shards.len())
            .map(|_| AtomicU64::new(0))
            .collect();
        publisher.layout = layout;
        publisher
    }

    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The connection of lane `shard`: its shard number's (all routes' shard `k` share the
    /// `{k}` hash tag, so a cluster node).
    fn conn_of(&self, shard: usize) -> &SharedConn {
        &self.shard_conns[shard % self.shard_conns.len()]
    }

    /// A publisher for one session: its own epochs (claimed by [`Self::claim_writer_epoch`])
    /// and its id offset.
    pub(crate) fn for_session(&self, id_offset: u64) -> Self {
        let mut session = self.clone();
        session.writer_epochs = (0..self.shards.len()).map(|_| AtomicU64::new(0)).collect();
        session.id_offset = id_offset;
        session
    }

    pub(crate) fn id_offset(&self) -> u64 {
        self.id_offset
    }

    /// Claim `shard` for this session, which holds `slot` (see [`Records::claim_epoch`]),
    /// and write it with that epoch from now on. With replicas to wait for, the claim counts
    /// only once they have it (a failover must not bring back a record without it).
    pub(crate) async fn claim_writer_epoch(
        &mut self,
        shard: u32,
        slot: &str,
    ) -> Result<u64, RelayError> {
        let mut records = self.records_of(shard);
        let epoch = records.claim_epoch(slot).await?;
        if self.wait_replicas > 0 && epoch > 0 {
            let keys = &self.shards[shard as usize];
            let mut touch = redis::cmd("HINCRBY");
            touch.arg(&keys.origin_key).arg("claims").arg(1);
            let (_, replicas) = self
                .conn_of(shard as usize)
                .get()
                .then_wait(touch, &keys.stream, self.wait_replicas, self.timeout / 2)
                .await?;
            if replicas < self.wait_replicas {
                return Err(self.wait_fell_short(shard as usize, replicas));
            }
        }
        self.writer_epochs[shard as usize].store(epoch, Ordering::SeqCst);
        Ok(epoch)
    }

    /// The stream's configured name (with one shard, its key; a template when routed).
    pub(crate) fn stream(&self) -> &str {
        self.layout.template()
    }

    /// Lanes of the session (shards of every route's stream).
    pub(crate) fn shard_count(&self) -> u32 {
        self.shards.len() as u32
    }

    /// The stream key of `shard`.
    pub(crate) fn shard_stream(&self, shard: u32) -> &str {
        &self.shards[shard as usize].stream
    }

    /// Trim from `shard` what every consumer group acknowledged; the entries left (unread
    /// by some group) and how many groups read the shard.
    pub(crate) async fn room(&mut self, shard: u32) -> Result<(u64, u64), RelayError> {
        let keys = &self.shards[shard as usize];
        let (entries, groups): (u64, u64) = MAKE_ROOM
            .key(&keys.stream)
            .invoke_async(&mut self.conn_of(shard as usize).get())
            .await?;
        Ok((entries, groups))
    }

    /// The most unread entries a stream may hold (`--stream-max-len`; 0: no cap).
    pub(crate) fn max_len(&self) -> u64 {
        self.max_len
    }

    /// Refuse to write when the records say a stream has another shard count than this
    /// relay's (`records`: every lane's, as read, in lane order), or the other key layout
    /// has a record.
    pub(crate) async fn check_layout(
        &mut self,
        records: &[Option<StreamRecord>],
    ) -> Result<(), RelayError> {
        let shards = self.layout.shards();
        for (route, base) in self.layout.bases().iter().enumerate() {
            let lanes = route * shards as usize..(route + 1) * shards as usize;
            let recorded: Vec<u32> = records[lanes]
                .iter()
                .flatten()
                .filter(|r| r.exists())
                .map(|r| r.shards.unwrap_or(0))
                .collect();
            check_layout(&mut self.conn.get(), base, shards, recorded).await??;
        }
        Ok(())
    }

    /// The record of every shard, in shard order, with this publisher's connection.
    pub(crate) fn records(&self) -> Vec<Records> {
        (0..self.shard_count())
            .map(|k| self.records_of(k))
            .collect()
    }

    /// The record of `shard`.
    pub(crate) fn records_of(&self, shard: u32) -> Records {
        Records::new(
            self.conn_of(shard as usize).get(),
            &self.shards[shard as usize].stream,
        )
    }

    /// The anchor lane's connection (for the rebuild lock, which lives beside its record).
    pub(crate) fn connection(&self) -> RedisConn {
        self.conn_of(self.layout.anchor() as usize).get()
    }

    /// The anchor lane (see [`Layout::anchor`]): the rebuild lock lives beside its record.
    pub(crate) fn anchor(&self) -> u32 {
        self.layout.anchor()
    }

    /// Whether Redis holds the relay's functions (loading them when this user may): asked
    /// before a session reads from the slot, so a Redis that lost them (and a user that may
    /// not load them) holds the relay here, saying so, not in a loop of replication starts.
    pub(crate) async fn check_functions(&self) -> Result<(), RelayError> {
        let _: i64 = READY.call().invoke_async(&mut self.connection()).await?;
        Ok(())
    }

    /// Publish `entries` (all of shard `shard`, ids increasing) as one call, recording what
    /// `meta` says in the shard's record.
    pub(crate) async fn publish_part(
        &mut self,
        shard: usize,
        entries: &[&StreamEntry],
        meta: &PartMeta,
        origin: &Origin,
    ) -> Result<PublishOutcome, RelayError> {
        let reply = self.eval(shard, entries, meta, origin).await;
        let reply = match reply {
            Err(e) if functions::is_missing(&e) => {
                // A Redis that lost its data (or a new cluster node) lost the functions too:
                // load them again when this user may (on every primary of a cluster), and
                // resend. Every node restarted at once leaves a cluster connection with none
                // of its nodes here.
                if let Err(e) = PUBLISH
                    .call()
                    .load_library(&mut self.conn_of(shard).get())
                    .await
                {
                    let e = RelayError::from(e);
                    self.conn_of(shard).renew_if_lost(&e).await;
                    return Err(e);
                }
                self.eval(shard, entries, meta, origin).await
            }
            other => other,
        };
        let (reply, replicas) = match reply {
            Ok(reply) => reply,
            Err(e) => {
                let e = self.script_error(shard, e, origin);
                self.conn_of(shard).renew_if_lost(&e).await;
                return Err(e);
            }
        };
        let outcome = parse_outcome(reply)?;
        if let Some(acked) = replicas.filter(|n| *n < self.wait_replicas) {
            // Not confirmed: sent again (idempotent) until enough replicas have it.
            return Err(self.wait_fell_short(shard, acked));
        }
        Ok(outcome)
    }

    fn wait_fell_short(&self, shard: usize, acked: u32) -> RelayError {
        RelayError::Redis(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "WAIT: {acked} of {} replicas acknowledged {} in time",
                self.wait_replicas, self.shards[shard].stream
            ),
        )))
    }

    /// The script call, followed on the same connection by `WAIT` when replicas must
    /// confirm (their count comes back too).
    async fn eval(
        &mut self,
        shard: usize,
        entries: &[&StreamEntry],
        meta: &PartMeta,
        origin: &Origin,
    ) -> redis::RedisResult<(Value, Option<u32>)> {
        let keys = &self.shards[shard];
        let mut cmd = redis::cmd("FCALL");
        let (watermark, watermark_from) = match &meta.watermark {
            Some(w) => (
                w.encode(),
                EntryId {
                    commit_lsn: w.lo.as_u64() + self.id_offset,
                    seq: 0,
                }
                .to_string(),
            ),
            None => (String::new(), String::new()),
        };
        cmd.arg(PUBLISH.name())
            .arg(2)
            .arg(&keys.stream)
            .arg(&keys.origin_key)
            .arg(&origin.system_id)
            .arg(origin.timeline)
            .arg(self.max_len)
            .arg(meta.fence.map(|id| id.to_string()).unwrap_or_default())
            .arg(
                meta.ack_lsn
                    .map(|lsn| lsn.as_u64().to_string())
                    .unwrap_or_default(),
            )
            .arg(self.layout.shards())
            .arg(self.writer_epochs[shard].load(Ordering::SeqCst))
            .arg(watermark)
            .arg(watermark_from)
            .arg(if meta.rejoin { "rejoin" } else { "" })
            .arg(meta.cursor.as_deref().unwrap_or_default())
            .arg(meta.done.as_deref().unwrap_or_default());
        // The field names once (the contract's, then every extra field of the part), then
        // per entry its id, which of them it has, and their values.
        let names = FieldNames::of(entries.iter().map(|e| &e.event));
        cmd.arg(names.0.len());
        for name in &names.0 {
            cmd.arg(*name);
        }
        let mut id_buf = String::with_capacity(40);
        let mut presence = Vec::with_capacity(names.0.len());
        let mut values: Vec<&[u8]> = Vec::with_capacity(names.0.len());
        let mut run: Vec<u8> = Vec::new();
        let mut rest = entries;
        while let Some(first) = rest.first() {
            // A run: the entries from here on that have the same fields.
            names.layout(&first.event, &mut run, &mut values);
            let len = rest
                .iter()
                .position(|e| {
                    names.layout(&e.event, &mut presence, &mut values);
                    presence != run
                })
                .unwrap_or(rest.len());
            cmd.arg(&run[..]).arg(len);
            for entry in &rest[..len] {
                use std::fmt::Write;
                id_buf.clear();
                let _ = write!(id_buf, "{}", entry.id);
                names.layout(&entry.event, &mut presence, &mut values);
                cmd.arg(id_buf.as_bytes());
                for value in &values {
                    cmd.arg(*value);
                }
            }
            rest = &rest[len..];
        }
        if self.wait_replicas == 0 {
            return Ok((cmd.query_async(&mut self.conn_of(shard).get()).await?, None));
        }
        // WAIT counts the writes of the connection it arrives on: it must follow the
        // script on the same one, so both go as one pipeline. Its own timeout stays well
        // inside the response timeout.
        let (reply, replicas) = self
            .conn_of(shard)
            .get()
            .then_wait(cmd, &keys.stream, self.wait_replicas, self.timeout / 2)
            .await?;
        Ok((reply, Some(replicas)))
    }

    fn script_error(&self, shard: usize, e: redis::RedisError, origin: &Origin) -> RelayError {
        let detail = e.detail().unwrap_or_default().to_string();
        let stream = &self.shards[shard].stream;
        match e.code() {
            Some(script_codes::ORIGIN) => RelayError::OriginMismatch {
                stream: stream.clone(),
                stream_system: detail,
                server_system: origin.system_id.clone(),
            },
            Some(script_codes::GAP) => RelayError::StreamBehind {
                stream: stream.clone(),
                detail,
            },
            Some(script_codes::DIVERGED) => RelayError::StreamDiverged {
                stream: stream.clone(),
                detail,
            },
            Some(script_codes::NORECORD) => RelayError::RecordMissing {
                stream: stream.clone(),
            },
            Some(script_codes::SHARDS) => RelayError::Config(format!(
                "stream {} now states {detail} shard(s) (it was resized while this relay ran): restart the relay with --stream-shards {detail}",
                self.layout.base_of(shard as u32)
            )),
            Some(script_codes::FENCED) => RelayError::Superseded {
                stream: stream.clone(),
                detail,
            },
            Some(script_codes::TIMELINE) => RelayError::TimelineMismatch {
                stream: stream.clone(),
                detail,
            },
            Some(script_codes::FULL) => RelayError::StreamFull {
                stream: stream.clone(),
                detail,
            },
            _ => RelayError::Redis(e),
        }
    }
}

fn parse_outcome(reply: Value) -> Result<PublishOutcome, RelayError> {
    let unexpected =
        |what: &Value| RelayError::Protocol(format!("publish script returned {what:?}"));
    match &reply {
        Value::Array(items) if items.len() == 3 => {
            let int = |v: &Value| match v {
                Value::Int(n) if *n >= 0 => Ok(*n as u64),
                other => Err(unexpected(other)),
            };
            let acked_below = match &items[2] {
                Value::BulkString(b) if b.is_empty() => None,
                Value::BulkString(b) => Some(
                    std::str::from_utf8(b)
                        .ok()
                        .and_then(|t| t.parse().ok())
                        .ok_or_else(|| unexpected(&items[2]))?,
                ),
                other => return Err(unexpected(other)),
            };
            Ok(PublishOutcome {
                published: int(&items[0])?,
                duplicates: int(&items[1])?,
                acked_below,
            })
        }
        other => Err(unexpected(other)),
    }
}

/// The field names of one publishing call: the contract's, in its order, then the extra
/// fields its entries carry, each once (see `publish.lua`).
struct FieldNames<'a>(Vec<&'a [u8]>);

impl<'a> FieldNames<'a> {
    /// `event`, `payload` and `outbox_id` first: every entry has them.
    const CONTRACT: [&'static str; 6] = [
        entry::EVENT,
        entry::PAYLOAD,
        entry::OUTBOX_ID,
        entry::CREATED_AT,
        entry::TRACEPARENT,
        entry::KEY,
    ];

    fn of(events: impl Iterator<Item = &'a OutboxEvent>) -> Self {
        let mut names: Vec<&[u8]> = Self::CONTRACT.iter().map(|n| n.as_bytes()).collect();
        for event in events {
            for (name, _) in &event.extra {
                if !names[Self::CONTRACT.len()..].contains(&&name[..]) {
                    names.push(&name[..]);
                }
            }
        }
        Self(names)
    }

    /// Which names `event` has ('1'/'0' each) and their values, in the names' order.
    fn layout<'e>(
        &self,
        event: &'e OutboxEvent,
        presence: &mut Vec<u8>,
        values: &mut Vec<&'e [u8]>,
    ) {
        presence.clear();
        values.clear();
        let contract = [
            Some(&event.event[..]),
            Some(&event.payload[..]),
            Some(&event.outbox_id[..]),
            event.created_at.as_deref(),
            event.traceparent.as_deref(),
            event.key.as_deref(),
        ];
        let extra = self.0[Self::CONTRACT.len()..].iter().map(|name| {
            event
                .extra
                .iter()
                .find(|(n, _)| &n[..] == *name)
                .map(|(_, v)| &v[..])
        });
        for value in contract.into_iter().chain(extra) {
            presence.push(if value.is_some() { b'1' } else { b'0' });
            values.extend(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_adds_the_named_fields_an_entry_has_then_published_at() {
        let add = SCRIPT
            .split("local function add(n)")
            .nth(1)
            .and_then(|rest| rest.split("\nend\n").next())
            .expect("publish.lua defines add()");
        assert_eq!(add.matches("redis.call('XADD'").count(), 1, "{add}");
        assert!(
            add.find("args[k + 1] = name").unwrap()
                < add.find("'published_at', published_at").unwrap(),
            "{add}"
        );
    }

    #[test]
    fn each_entry_says_which_names_it_has_and_gives_their_values_in_order() {
        use bytes::Bytes;
        let event =
            |extra: Vec<(&'static str, &'static str)>, key: Option<&'static str>| OutboxEvent {
                outbox_id: Bytes::from_static(b"7"),
                event: Bytes::from_static(b"e"),
                payload: Bytes::from_static(b"{}"),
                created_at: None,
                key: key.map(|k| Bytes::from_static(k.as_bytes())),
                traceparent: None,
                extra: extra
                    .into_iter()
                    .map(|(k, v)| {
                        (
                            Bytes::from_static(k.as_bytes()),
                            Bytes::from_static(v.as_bytes()),
                        )
                    })
                    .collect(),
                route: None,
            };
        let a = event(vec![("tenant", "t1")], Some("k"));
        let b = event(vec![("region", "eu"), ("tenant", "t2")], None);
        let names = FieldNames::of([&a, &b].into_iter());
        let text: Vec<&str> = names
            .0
            .iter()
            .map(|n| std::str::from_utf8(n).unwrap())
            .collect();
        assert_eq!(
            text,
            [
                "event",
                "payload",
                "outbox_id",
                "created_at",
                "traceparent",
                "key",
                "tenant",
                "region"
            ]
        );
        let (mut presence, mut values) = (Vec::new(), Vec::new());
        names.layout(&a, &mut presence, &mut values);
        assert_eq!(presence, b"11100110");
        assert_eq!(values, [&b"e"[..], b"{}", b"7", b"k", b"t1"]);
        names.layout(&b, &mut presence, &mut values);
        assert_eq!(presence, b"11100011");
        assert_eq!(values, [&b"e"[..], b"{}", b"7", b"t2", b"eu"]);
    }
}
