//! Live hints between the instances of one side, and the safety net under them.
//!
//! Any instance commits to a chat's feed: the one holding the inbox lease records received
//! messages, every instance records sends. The committing instance hands the message to its
//! own hub at once and to the other instances through a Redis pub/sub channel. Hints are
//! only a shortcut, so each way one can get lost is covered:
//! - a PUBLISH that fails (Redis down, an ACL refusing it) or a hint dropped because the
//!   queue was full leaves a resync owed, published as soon as Redis takes it again;
//! - a subscriber whose feed broke (Redis restarted, connection lost) re-reads on reconnect;
//! - a process killed between its commit and its hint is covered by `tips::watch_tips`, which
//!   compares every subscribed chat's newest position with what streams have sent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use outbox_core::backoff::Backoff;
use outbox_core::connect::{RedisConn, RedisTarget};
use outbox_core::stream::keys;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::live::hub::{frame, Delivery, Hub};
use crate::metrics::Metrics;
use crate::model::HistoryItem;
use crate::side::Side;

/// Hints queued for the Redis publisher before new ones are dropped (and a resync owed).
const QUEUE: usize = 4096;

/// Instance id in notifications, so an instance skips its own.
fn instance_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| uuid::Uuid::new_v4().simple().to_string())
}

/// The side's hint channel. Named after the feed (ids `p<pos>`): instances of the previous
/// version, which sent side-wide inbox positions, use [`legacy_channel`], so neither
/// misreads the other's positions.
fn channel(side: Side) -> String {
    keys::feed_channel(side.as_str())
}

/// The previous version's channel. During a rolling deploy the two versions tell each
/// other only "re-read": a resync (at most every [`LEGACY_EVERY`], after hints) from this
/// version, and from theirs a hint read here as "that chat changed".
fn legacy_channel(side: Side) -> String {
    keys::legacy_hint_channel(side.as_str())
}

/// How often at most instances of the previous version are told to re-read.
const LEGACY_EVERY: Duration = Duration::from_secs(1);

/// A notification as the previous version sends and reads it.
#[derive(serde::Serialize, serde::Deserialize)]
struct LegacyNotification {
    from: String,
    chat_id: i64,
    seq: i64,
    frame: String,
    #[serde(default)]
    resync: bool,
    /// Set by this version (the previous one ignores unknown fields): this version's
    /// instances skip such notes, which are meant for the previous version only and would
    /// otherwise make every instance re-read every stream every second, for good.
    #[serde(default)]
    feed: bool,
}

impl LegacyNotification {
    fn resync() -> Self {
        Self {
            from: instance_id().to_string(),
            chat_id: 0,
            seq: 0,
            frame: String::new(),
            resync: true,
            feed: true,
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Notification {
    from: String,
    chat_id: i64,
    pos: i64,
    frame: String,
    /// Something may have been missed: every stream re-reads its chat's feed.
    #[serde(default)]
    resync: bool,
    /// A received message's recording (instances before it send none). One this version
    /// cannot read is dropped, not the hint with it.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient"
    )]
    delivery: Option<Delivery>,
}

fn lenient<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Delivery>, D::Error> {
    let value = <serde_json::Value as serde::Deserialize>::deserialize(d)?;
    Ok(serde_json::from_value(value).ok())
}

/// Hands committed feed items to this instance's streams and, through Redis, to the other
/// instances'. Never blocks and never fails: what it cannot deliver is owed as a resync.
#[derive(Clone)]
pub(crate) struct Announcer {
    hub: Arc<Hub>,
    queue: mpsc::Sender<Notification>,
    /// A hint was dropped or not published: a resync must go out.
    owed: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
}

impl Announcer {
    /// An announcer and the publisher task that must run for its hints to leave.
    pub(crate) fn new(
        hub: Arc<Hub>,
        client: RedisTarget,
        side: Side,
        metrics: Arc<Metrics>,
    ) -> (Self, Publisher) {
        let (queue, rx) = mpsc::channel(QUEUE);
        let owed = Arc::new(AtomicBool::new(false));
        let publisher = Publisher {
            client,
            side,
            rx,
            owed: owed.clone(),
            metrics: metrics.clone(),
        };
        (
            Self {
                hub,
                queue,
                owed,
                metrics,
            },
            publisher,
        )
    }

    /// Show a committed item on every instance.
    pub(crate) fn announce(&self, item: &HistoryItem, delivery: Option<Delivery>) {
        let frame = frame(item);
        let note = Notification {
            from: instance_id().to_string(),
            chat_id: item.message.chat_id,
            pos: item.pos,
            frame: String::from_utf8_lossy(&frame).into_owned(),
            resync: false,
            delivery: delivery.clone(),
        };
        self.hub.publish(
            item.message.chat_id,
            item.pos,
            frame,
            delivery.map(Arc::new),
        );
        if self.queue.try_send(note).is_err() {
            self.metrics.live_hints_unpublished_total.inc();
            self.owed.store(true, Ordering::SeqCst);
        }
    }

    /// Make every stream on every instance re-read its chat's feed (a new inbox writer took
    /// over: what the previous one recorded and never announced is shown now).
    pub(crate) fn resync(&self) {
        self.hub.resync_all();
        self.owed.store(true, Ordering::SeqCst);
        // Wake the publisher; if the queue is full it is busy and will see the flag.
        let _ = self.queue.try_send(resync_note());
    }
}

fn resync_note() -> Notification {
    Notification {
        from: instance_id().to_string(),
        chat_id: 0,
        pos: 0,
        frame: String::new(),
        resync: true,
        delivery: None,
    }
}

/// Tell every instance of `side` to re-read its chats' feeds (from outside a service: an
/// operator's command that wrote to the feed).
pub(crate) async fn publish_resync(client: &RedisTarget, side: Side) -> redis::RedisResult<()> {
    let mut conn = client.connect(Duration::from_secs(5)).await?;
    let payload = serde_json::to_string(&resync_note()).expect("notification serializes");
    publish(&mut conn, client.is_cluster(), &channel(side), &payload).await?;
    if !client.is_cluster() {
        let legacy =
            serde_json::to_string(&LegacyNotification::resync()).expect("notification serializes");
        publish(&mut conn, false, &legacy_channel(side), &legacy).await?;
    }
    Ok(())
}

/// `PUBLISH`, or on a cluster `SPUBLISH`: a sharded channel lives on the node of its slot
/// (plain pub/sub there would copy every hint to every node of the cluster).
async fn publish(
    conn: &mut RedisConn,
    sharded: bool,
    channel: &str,
    payload: &str,
) -> redis::RedisResult<()> {
    let _: i64 = redis::cmd(if sharded { "SPUBLISH" } else { "PUBLISH" })
        .arg(channel)
        .arg(payload)
        .query_async(conn)
        .await?;
    Ok(())
}

/// Publishes an [`Announcer`]'s hints to Redis, in order, until shutdown.
pub(crate) struct Publisher {
    client: RedisTarget,
    side: Side,
    rx: mpsc::Receiver<Notification>,
    owed: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
}

impl Publisher {
    pub(crate) async fn run(mut self, shutdown: CancellationToken) {
        let mut backoff = Backoff::reconnecting(Duration::from_millis(100));
        let mut conn: Option<RedisConn> = None;
        // When instances of the previous version are owed a resync (see LEGACY_EVERY).
        let mut legacy_due: Option<Instant> = None;
        let mut legacy_sent = Instant::now() - LEGACY_EVERY;
        loop {
            // A resync owed goes out before anything else; until it does, single hints
            // are moot (the resync covers them) and are dropped.
            let note = if self.owed.load(Ordering::SeqCst) {
                while self.rx.try_recv().is_ok() {}
                self.owed.store(false, Ordering::SeqCst);
                resync_note()
            } else {
                let legacy_at = legacy_due.unwrap_or_else(Instant::now);
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    note = self.rx.recv() => match note {
                        Some(note) => note,
                        None => return,
                    },
                    _ = tokio::time::sleep_until(legacy_at), if legacy_due.is_some() => {
                        let payload = serde_json::to_string(&LegacyNotification::resync())
                            .expect("notification serializes");
                        match self.publish(&mut conn, &legacy_channel(self.side), &payload).await {
                            Ok(()) => legacy_due = None,
                            Err(_) => legacy_due = Some(Instant::now() + LEGACY_EVERY),
                        }
                        legacy_sent = Instant::now();
                        continue;
                    }
                }
            };
            let resync = note.resync;
            let payload = serde_json::to_string(&note).expect("notification serializes");
            match self.publish(&mut conn, &channel(self.side), &payload).await {
                Ok(()) => {
                    if resync {
                        debug!("resync published");
                    }
                    backoff.reset();
                    // No previous version ever ran on a cluster.
                    if !self.client.is_cluster() {
                        legacy_due.get_or_insert(legacy_sent + LEGACY_EVERY);
                    }
                }
                Err(e) => {
                    self.metrics.live_hints_unpublished_total.inc();
                    self.owed.store(true, Ordering::SeqCst);
                    let delay = backoff.next_delay();
                    warn!(error = %e, retry_in = ?delay, "live hint not published; a resync is owed to the other instances");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    async fn publish(
        &self,
        conn: &mut Option<RedisConn>,
        channel: &str,
        payload: &str,
    ) -> redis::RedisResult<()> {
        if conn.is_none() {
            *conn = Some(self.client.connect(Duration::from_secs(2)).await?);
        }
        let conn = conn.as_mut().expect("connected above");
        publish(conn, self.client.is_cluster(), channel, payload).await
    }
}

/// Another instance's hint: a chat, a position, and how the message was recorded. Only
/// the position is taken from it: the message shown is read from the database.
struct Hint {
    chat_id: i64,
    pos: i64,
    delivery: Option<Delivery>,
}

/// Hints waiting for their messages to be read, before new ones are dropped (and their
/// chats re-read by their streams instead).
const FETCH_QUEUE: usize = 4096;
/// Hints read from the database together at most.
const FETCH_BATCH: usize = 256;
/// Positions of one chat read at once for hints at most; a wider spread is left to the
/// chat's streams (a resync).
const FETCH_SPAN: i64 = 500;

/// Feed other instances' hints into the local hub until `shutdown`: each hint's message is
/// read from `store` (see [`fetch`]).
pub(crate) async fn follow(
    client: RedisTarget,
    side: Side,
    hub: Arc<Hub>,
    store: crate::store::Store,
    shutdown: CancellationToken,
) {
    let (hints, queue) = mpsc::channel(FETCH_QUEUE);
    let fetching = tokio::spawn(fetch(store, hub.clone(), queue));
    let _fetching = AbortOnDrop(fetching);
    let mut backoff = Backoff::reconnecting(Duration::from_millis(200));
    loop {
        let session = async {
            match &client {
                RedisTarget::Single(single) => {
                    follow_single(single, side, &hub, &hints, &mut backoff).await
                }
                RedisTarget::Cluster { .. } => {
                    follow_sharded(&client, side, &hub, &hints, &mut backoff).await
                }
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            ended = session => {
                if let Err(e) = ended {
                    warn!(error = %e, "live hint feed interrupted");
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

/// Ends a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Hand a hint read from the side's channel to the hub: a resync at once, another
/// instance's message through [`fetch`]. The frame a hint carries is never shown: whoever
/// may publish on the channel cannot make a browser show anything the database does not
/// hold (it can only make instances read their own feed).
fn take_note(hub: &Hub, fetch: &mpsc::Sender<Hint>, payload: &str) {
    let Ok(note) = serde_json::from_str::<Notification>(payload) else {
        return;
    };
    if note.resync {
        hub.resync_all();
    } else if note.from != instance_id() {
        let hint = Hint {
            chat_id: note.chat_id,
            pos: note.pos,
            delivery: note.delivery,
        };
        match fetch.try_send(hint) {
            Ok(()) => {}
            // Too many waiting: the chat's streams read it themselves.
            Err(mpsc::error::TrySendError::Full(hint)) => hub.resync_chat(hint.chat_id),
            // The reader is gone (it never ends before the follower: a bug); say so once.
            Err(mpsc::error::TrySendError::Closed(hint)) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| warn!("the reader of other instances' messages stopped; their messages are shown by the streams' own reads"));
                hub.resync_chat(hint.chat_id);
            }
        }
    }
}

/// Show other instances' messages here, as the database holds them: the hints of chats
/// with streams on this instance are read in batches (one query per chat and batch, from
/// the lowest position hinted to the highest), and each message found is handed to the
/// hub with the frame built from its row. A hint whose message is not there, or that
/// cannot be read now, makes the chat's streams re-read their feed (never a tip: a hinted
/// position is not trusted to be final).
async fn fetch(store: crate::store::Store, hub: Arc<Hub>, mut queue: mpsc::Receiver<Hint>) {
    let mut batch = Vec::with_capacity(FETCH_BATCH);
    while queue.recv_many(&mut batch, FETCH_BATCH).await > 0 {
        let watched: std::collections::HashSet<i64> = hub.chat_ids().into_iter().collect();
        let mut chats: HashMap<i64, Vec<Hint>> = HashMap::new();
        for hint in batch.drain(..) {
            if watched.contains(&hint.chat_id) && hint.pos > 0 {
                chats.entry(hint.chat_id).or_default().push(hint);
            }
        }
        for (chat_id, hints) in chats {
            let low = hints.iter().map(|h| h.pos).min().expect("one at least");
            let high = hints.iter().map(|h| h.pos).max().expect("one at least");
            let span = (high - low + 1).min(FETCH_SPAN);
            match store.feed(chat_id, low - 1, span).await {
                Ok(items) => {
                    let mut deliveries: HashMap<i64, Delivery> = hints
                        .into_iter()
                        .filter_map(|h| Some((h.pos, h.delivery?)))
                        .collect();
                    let mut missing = false;
                    for pos in low..=high.min(low + span - 1) {
                        match items.iter().find(|item| item.pos == pos) {
                            Some(item) => hub.publish(
                                chat_id,
                                pos,
                                frame(item),
                                deliveries.remove(&pos).map(Arc::new),
                            ),
                            None => missing = true,
                        }
                    }
                    if missing || high >= low + span {
                        hub.resync_chat(chat_id);
                    }
                }
                Err(e) => {
                    debug!(chat_id, error = %e, "could not read a hinted message; its streams re-read the feed");
                    hub.resync_chat(chat_id);
                }
            }
        }
    }
}

/// One subscription on a single server, until it breaks or stops answering: a PING on the
/// subscribed connection every [`PROBE_EVERY`] must come back within it (a server gone
/// behind a connection the kernel still holds open would otherwise leave the hints silent
/// for as long as TCP takes to notice).
async fn follow_single(
    client: &redis::Client,
    side: Side,
    hub: &Hub,
    fetch: &mpsc::Sender<Hint>,
    backoff: &mut Backoff,
) -> redis::RedisResult<()> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(channel(side)).await?;
    pubsub.subscribe(legacy_channel(side)).await?;
    // Anything published while we were not subscribed is in the database.
    hub.resync_all();
    backoff.reset();
    let legacy = legacy_channel(side);
    let (mut sink, mut messages) = pubsub.split();
    let mut probe = tokio::time::interval(PROBE_EVERY);
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let msg = tokio::select! {
            msg = messages.next() => msg,
            _ = probe.tick() => {
                match tokio::time::timeout(PROBE_EVERY * 2, sink.ping::<redis::Value>()).await {
                    Ok(Ok(_)) => continue,
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        return Err(redis::RedisError::from(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "the live hint subscription did not answer a PING",
                        )))
                    }
                }
            }
        };
        let Some(msg) = msg else { return Ok(()) };
        let Ok(payload) = msg.get_payload::<String>() else {
            continue;
        };
        if msg.get_channel_name() == legacy {
            match serde_json::from_str::<LegacyNotification>(&payload) {
                Ok(note) if note.feed || note.from == instance_id() => {}
                Ok(note) if note.resync => hub.resync_all(),
                Ok(note) => hub.resync_chat(note.chat_id),
                Err(_) => {}
            }
            continue;
        }
        take_note(hub, fetch, &payload);
    }
}

/// How often the node of the sharded channel is asked whether it still has us subscribed.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// One sharded subscription on a cluster, until it is in doubt. redis-rs subscribes again
/// where the channel's slot moves when it notices a node died, but not after the server
/// dropped the subscription itself (the slot moved by a manual failover or a resharding:
/// `sunsubscribe`), and it notices a dead node only when a command to it fails. So the
/// session ends on a `sunsubscribe` and on a probe that finds the channel's master gone or
/// without subscribers (a fresh connection subscribes wherever the slot lives now), and
/// every (re)subscription and disconnection re-reads the feeds, since hints may have gone
/// by meanwhile.
async fn follow_sharded(
    client: &RedisTarget,
    side: Side,
    hub: &Hub,
    fetch: &mpsc::Sender<Hint>,
    backoff: &mut Backoff,
) -> redis::RedisResult<()> {
    let channel = channel(side);
    let (pushes, mut received) = mpsc::unbounded_channel();
    let mut conn = client
        .subscribe_sharded(&channel, pushes, Duration::from_secs(2))
        .await
        .expect("a cluster target")?;
    hub.resync_all();
    backoff.reset();
    let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::with_slot(
        Slot::for_key(channel.as_bytes()),
        SlotAddr::Master,
    )));
    let mut probe = tokio::time::interval(PROBE_EVERY);
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let doubt = |why: &'static str| redis::RedisError::from((redis::ErrorKind::Io, why));
    loop {
        tokio::select! {
            push = received.recv() => {
                let Some(push) = push else {
                    return Ok(());
                };
                match push.kind {
                    redis::PushKind::SMessage => {
                        if let Some(Ok(payload)) =
                            push.data.get(1).map(redis::from_redis_value_ref::<String>)
                        {
                            take_note(hub, fetch, &payload);
                        }
                    }
                    redis::PushKind::SUnsubscribe => {
                        hub.resync_all();
                        return Err(doubt("the sharded hint channel's slot moved (sunsubscribe)"));
                    }
                    redis::PushKind::SSubscribe | redis::PushKind::Disconnection => {
                        debug!(kind = %push.kind, "sharded hint channel changed; re-reading the feeds");
                        hub.resync_all();
                    }
                    _ => {}
                }
            }
            _ = probe.tick() => {
                let answered = tokio::time::timeout(
                    PROBE_EVERY * 2,
                    conn.route_command(
                        redis::cmd("PUBSUB").arg("SHARDNUMSUB").arg(&channel).clone(),
                        route.clone(),
                    ),
                )
                .await;
                match answered {
                    Ok(Ok(reply)) => {
                        let subscribers = redis::from_redis_value::<HashMap<String, i64>>(reply)
                            .ok()
                            .and_then(|counts| counts.get(&channel).copied())
                            .unwrap_or(0);
                        if subscribers == 0 {
                            hub.resync_all();
                            return Err(doubt(
                                "the sharded hint channel's master has no subscriber: the slot moved",
                            ));
                        }
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        return Err(doubt("the sharded hint channel's node did not answer a probe"))
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hint_keeps_its_delivery_and_survives_one_it_cannot_read() {
        let note = Notification {
            from: "a".into(),
            chat_id: 7,
            pos: 3,
            frame: "f".into(),
            resync: false,
            delivery: Some(Delivery {
                recorded_at_micros: 5,
                traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            }),
        };
        let json = serde_json::to_string(&note).unwrap();
        let back: Notification = serde_json::from_str(&json).unwrap();
        assert_eq!(back.delivery, note.delivery);
        // From an instance before deliveries, and from a later one that changed its form.
        for json in [
            r#"{"from":"a","chat_id":7,"pos":3,"frame":"f"}"#,
            r#"{"from":"a","chat_id":7,"pos":3,"frame":"f","delivery":{"recorded_at_micros":"soon"}}"#,
        ] {
            let note: Notification = serde_json::from_str(json).unwrap();
            assert_eq!((note.pos, note.delivery), (3, None));
        }
    }
}
