//! The relay loop: replication events in, Redis stream entries out, slot acknowledgements back.
//!
//! Invariant: the slot is never acknowledged past a transaction whose entries a live shard has
//! not confirmed. Everything held in memory here may vanish at any moment; Postgres re-sends it
//! because we did not acknowledge it, and Redis rejects the part it already has (stream ids
//! are derived from commit LSNs). A shard that fell behind is not waited for: what it lacks is
//! in the outbox table, which its catch-up (`recovery::catch_up`) publishes, handing it back
//! here at a transaction boundary.
//!
//! Batches are sealed as soon as nothing more is waiting (natural batching) and go to the
//! ordered pipeline (`sink::Pipeline`: per shard up to two in flight, confirmed strictly in
//! order). Acknowledgements are the `end_lsn` of the last transaction whose Commit was in a
//! batch every live shard confirmed (never `Commit.lsn`, which makes Postgres re-send that
//! transaction), or a keepalive's `wal_end` when nothing is open or unconfirmed (so an idle
//! outbox does not pin WAL while other tables are busy).
//!
//! The connection has a deadline: a server silent for `--replication-timeout` while the loop
//! is ready to read ends the session (see `source::replication`).
//!
//! The session never holds the server: a fast shutdown (and so a switchover) waits until
//! each walsender's client confirmed everything it was sent, asking with reply-requested
//! keepalives. An idle session confirms at once; one that cannot confirm within
//! `--shutdown-grace` (Redis down, a shard behind) ends, and the next session is sent the
//! rest again.

use std::time::Duration;

use futures::FutureExt;
use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationEvent};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use outbox_core::stream::EntryId;

use crate::config::{BatchLimits, OnLostSlot};
use crate::context::{Context, SharedContext};
use crate::decode::OutboxEvent;
use crate::decode::{self, PgOutput, RelationCache, Row};
use crate::error::RelayError;
use crate::recovery::{CatchUps, Handover, Started};
use crate::sink::layout::{Layout, NewRoute};
use crate::sink::{
    Batch, Confirmed, Event, Pipeline, PublishSpan, Sealed, StreamEntry, MAX_UNSEEN,
};
use crate::source::{
    replication_error, take_watermark, ReplicationPhase, Watermarks, WATERMARK_INTERVAL,
};
use crate::status::Role;

use crate::sink::PG_EPOCH_OFFSET_MICROS;

/// Stream from a started replication session until shutdown (`Ok`) or an error. Ids are
/// commit LSNs plus the session's id offset (see the record), and each live shard must
/// still hold its entry of `tops` (its last id when the session decided to stream).
pub(crate) async fn stream(
    ctx: &Context,
    started: Started,
    shutdown: &CancellationToken,
) -> Result<(), RelayError> {
    let Started {
        client,
        publisher,
        origin,
        tops,
        behind,
        held,
    } = started;
    let fences = tops
        .iter()
        .map(|top| (*top != EntryId::default()).then_some(*top))
        .collect();
    let cfg = &ctx.config;
    ctx.set_role(Role::Streaming);
    ctx.set_last_error(None);
    let watermarks = Watermarks::default();
    let taker = AbortOnDrop(tokio::spawn(take_watermarks(
        ctx.shared(),
        watermarks.clone(),
    )));
    let (handover_tx, handover) = mpsc::channel(16);
    let catch_ups = CatchUps::spawn(
        ctx.shared(),
        publisher.clone(),
        origin.clone(),
        watermarks.clone(),
        handover_tx,
        &behind,
    );
    let id_offset = publisher.id_offset();
    let session = Session {
        ctx,
        relations: RelationCache::mapped(cfg.postgres.outbox.clone(), cfg.stream_shards),
        state: State {
            limits: cfg.batch,
            open: None,
            filling: Batch::default(),
            acknowledged_lsn: Lsn(0),
            ack_only_not_before: Instant::now(),
            id_offset,
            layout: publisher.layout().clone(),
            next_ack_all: Instant::now(),
            finishing: false,
            pending_capture: None,
            last_heard: Instant::now(),
            confirm_asked: None,
            last_ask: None,
            messages_paused: false,
            next_probe: Instant::now(),
        },
        pipeline: Pipeline::new(
            publisher,
            origin,
            ctx.shared(),
            fences,
            held,
            &behind,
            watermarks,
        ),
        client,
        catch_ups,
        handover,
        _taker: taker,
    };
    session.stream(shutdown).await
}

/// Takes a watermark every [`WATERMARK_INTERVAL`] on a connection of its own, for the
/// session to record with acknowledgements (see `source::watermark`). A failure is retried
/// at the next tick: acknowledgements then carry an older one, which is only a wider bound.
async fn take_watermarks(ctx: SharedContext, watermarks: Watermarks) {
    let cfg = &ctx.config;
    let mut client: Option<tokio_postgres::Client> = None;
    let mut tick = tokio::time::interval(WATERMARK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = cfg
                .postgres
                .endpoint
                .connect(cfg.connect_timeout.min(Duration::from_secs(5)))
                .await
                .ok();
        }
        let Some(c) = &client else { continue };
        match tokio::time::timeout(Duration::from_secs(5), take_watermark(c)).await {
            Ok(Ok(watermark)) => {
                watermarks.push(watermark);
            }
            Ok(Err(e)) => {
                debug!(error = %e, "watermark not taken");
                client = None;
            }
            Err(_) => {
                debug!("watermark not taken in time");
                client = None;
            }
        }
    }
}

/// A task that ends with its owner.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Two asks for a reply this close are a stopping server's (it asks again as soon as our
/// worker answered; a quiet stream's pings come half a wal_sender_timeout apart).
const ASKED_AGAIN_WITHIN: Duration = Duration::from_millis(500);

/// A transaction between its Begin and its Commit.
struct OpenTransaction {
    commit_lsn: Lsn,
    commit_time_micros: i64,
    xid: u32,
    next_seq: u64,
    /// Transactional logical decoding messages seen so far, of any prefix (their position
    /// numbers them, so the ids do not change with the configured prefixes).
    messages_seen: u64,
    /// The ones to publish, by position, held until the Commit (their ids follow the rows').
    messages: Vec<(u64, OutboxEvent)>,
    messages_bytes: usize,
}

/// Where a transaction's messages are numbered from: above every row's position, so they
/// follow its rows in the stream whichever came first, and adding them never changed a
/// row's id. Ids come from the transaction's own commit LSN (as `Begin.final_lsn` says),
/// never from the message's LSN, which Postgres versions report differently.
const FIRST_MESSAGE_SEQ: u64 = 1 << 32;

/// What the loop's branches share, with the predicates that gate them.
struct State {
    limits: BatchLimits,
    open: Option<OpenTransaction>,
    filling: Batch,
    /// Last LSN acknowledged to the slot in this session.
    acknowledged_lsn: Lsn,
    /// A batch carrying only an acknowledgement (a keepalive's position, a commit without
    /// entries) waits until then, so a busy database with an idle outbox costs Redis a few
    /// small calls per second, not one per keepalive.
    ack_only_not_before: Instant,
    /// Added to commit LSNs to make stream ids.
    id_offset: u64,
    /// The session's streams: which lane a row goes to.
    layout: Layout,
    /// When the next batch sends its acknowledgement to every shard.
    next_ack_all: Instant,
    /// Stopping: every batch acknowledges in every shard.
    finishing: bool,
    /// A catch-up asked to capture these shards' entries, from the next transaction boundary.
    pending_capture: Option<(Vec<u32>, oneshot::Sender<Vec<u32>>)>,
    /// When the server was last heard (or the loop last could not read): the watchdog's base.
    last_heard: Instant,
    /// The server keeps asking (reply-requested keepalives, again and again) for a
    /// confirmation of everything it sent, up to this position, and it is not acknowledged
    /// yet: it is stopping. The session leaves at this deadline (the shutdown grace after
    /// the asking began).
    confirm_asked: Option<(Lsn, Instant)>,
    /// When the server last asked for a reply.
    last_ask: Option<Instant>,
    /// Reading waits for a shard behind that keeps too many tableless entries (said once).
    messages_paused: bool,
    /// While reading waits: when the server is next asked whether it still takes connections.
    next_probe: Instant,
}

impl State {
    /// The filling batch can take another event (otherwise: backpressure on the slot).
    fn has_room(&self) -> bool {
        self.filling.has_room(&self.limits)
    }
}

/// While reading waits for a shard behind, how often the server is asked whether it still
/// takes connections (see `Session::probe_server`).
const PAUSE_PROBE: Duration = Duration::from_secs(2);

struct Session<'a> {
    ctx: &'a Context,
    client: ReplicationClient,
    relations: RelationCache,
    state: State,
    pipeline: Pipeline,
    catch_ups: CatchUps,
    handover: mpsc::Receiver<Handover>,
    _taker: AbortOnDrop,
}

impl Session<'_> {
    /// Entries are waiting and the pipeline can take a batch.
    fn ready_to_publish(&self) -> bool {
        self.state.filling.has_entries() && self.pipeline.has_room_for(!self.state.has_room())
    }

    /// Only an acknowledgement is waiting (it goes out at `ack_only_not_before`).
    fn ack_only_waiting(&self) -> bool {
        !self.state.filling.has_entries()
            && self.state.filling.ack_lsn.is_some()
            && self.pipeline.has_room_for(false)
    }

    /// Nothing received is open or unconfirmed.
    fn is_idle(&self) -> bool {
        self.state.open.is_none() && !self.state.filling.has_entries() && self.pipeline.is_idle()
    }

    /// A capture can begin: one is asked for, and no transaction is half received.
    fn capture_due(&self) -> bool {
        self.state.pending_capture.is_some() && self.state.open.is_none()
    }

    /// The loop reads the next replication events: the batch has room (backpressure), and
    /// no shard behind keeps more than `--lane-max-bytes` of tableless entries, which no
    /// table can give back and so cannot be dropped (a transaction is read to its end first:
    /// a capture and a hand-over begin only between transactions, and one transaction's
    /// messages are bounded by the same flag, so a lane keeps at most twice that). The slot's
    /// feedback goes on meanwhile (the replication client answers the server), and reading
    /// resumes once the shard is live again and sends them.
    fn reading(&self) -> bool {
        self.state.has_room() && !self.messages_wait()
    }

    /// Reading waits for a shard behind that keeps too many tableless entries.
    fn messages_wait(&self) -> bool {
        self.state.open.is_none() && self.pipeline.messages_overflow().is_some()
    }

    /// While reading waits, whether the server still takes connections: one that refuses them
    /// is stopping (or switching over) and waits for this session's confirmations, which
    /// the pause would withhold forever; the session ends instead (the next one is sent the
    /// rest again).
    async fn probe_server(&self) -> Result<(), RelayError> {
        let timeout = self.ctx.config.connect_timeout.min(Duration::from_secs(5));
        let probe = async {
            let client = self.ctx.config.postgres.endpoint.connect(timeout).await?;
            client.simple_query("SELECT 1").await?;
            Ok::<_, RelayError>(())
        };
        match tokio::time::timeout(timeout, probe).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(RelayError::Restart(format!(
                "the server does not take connections while reading waits for a shard behind ({e}): it may be stopping"
            ))),
            Err(_) => Err(RelayError::Restart(
                "the server did not answer in time while reading waits for a shard behind".into(),
            )),
        }
    }

    /// Say (once per wait) that reading waits for a shard behind, and which.
    fn note_messages_pause(&mut self) {
        let waiting = self.pipeline.messages_overflow();
        match (waiting, self.state.messages_paused) {
            (Some(shard), false) if self.state.open.is_none() => {
                self.state.messages_paused = true;
                self.state.next_probe = Instant::now() + PAUSE_PROBE;
                self.ctx.metrics.messages_pauses_total.inc();
                warn!(
                    shard = %self.state.layout.label(shard),
                    "a shard behind keeps --lane-max-bytes of logical messages, which no table holds: reading waits until it is caught up and live again"
                );
            }
            (None, true) => {
                self.state.messages_paused = false;
                info!("reading resumes: the shard that kept the logical messages is live again");
            }
            _ => {}
        }
    }
}

impl Session<'_> {
    async fn stream(mut self, shutdown: &CancellationToken) -> Result<(), RelayError> {
        let result = self.stream_loop(shutdown).await;
        if result.is_err() {
            // Whatever it wrote is idempotent; the next session re-sends the rest.
            self.pipeline.abort();
        }
        result
    }

    async fn stream_loop(&mut self, shutdown: &CancellationToken) -> Result<(), RelayError> {
        // Registered once: polling a fresh `cancelled()` each turn would lock its mutex.
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        let silence_limit = self.ctx.config.replication_timeout;
        loop {
            if self.pipeline.unseen_count() > MAX_UNSEEN {
                return Err(RelayError::Restart(format!(
                    "more than {MAX_UNSEEN} transactions dropped for shards behind and shown by no watermark (are watermarks failing?)"
                )));
            }
            self.note_messages_pause();
            if !self.reading() {
                // Not reading: the server's silence is not the server's.
                self.state.last_heard = Instant::now();
            }
            let confirm_deadline = self.confirm_deadline();
            tokio::select! {
                biased;
                // 1. shutdown: stop reading, finish the healthy shards' calls, acknowledge, leave
                _ = &mut cancelled => return self.finish().await,
                // 2. a shard's part confirmed, or a shard fell behind
                event = self.pipeline.next_event(), if !self.pipeline.is_idle() => {
                    self.on_pipeline(event?);
                }
                // 3. a catch-up's hand-over
                Some(request) = self.handover.recv() => self.on_handover(request)?,
                // 4. only an acknowledgement waits: record it in Redis, then acknowledge (before
                // reading, so a server that keeps the stream busy cannot starve it)
                _ = tokio::time::sleep_until(self.state.ack_only_not_before), if self.ack_only_waiting() => {
                    self.state.ack_only_not_before = Instant::now() + self.ctx.config.status_interval;
                    self.start_publish();
                }
                // 5. the server waits for a confirmation this session could not give in time:
                // leave, so a stopping server is not held (the next session is sent it again)
                _ = tokio::time::sleep_until(confirm_deadline), if self.state.confirm_asked.is_some() => {
                    return Err(self.confirmation_overdue());
                }
                // 6. the next replication events, only while the batch has room (backpressure)
                received = self.client.recv(), if self.reading() => {
                    self.state.last_heard = Instant::now();
                    self.on_received(received)?;
                    // Take what is already waiting without another turn of the select.
                    while self.reading() {
                        match self.client.recv().now_or_never() {
                            Some(received) => self.on_received(received)?,
                            None => break,
                        }
                    }
                }
                // 7. a capture asked for begins at a transaction boundary
                _ = std::future::ready(()), if self.capture_due() => self.begin_capture(),
                // 8. nothing more is waiting: publish what we have now (no timer, no added latency)
                _ = std::future::ready(()), if self.ready_to_publish() => self.start_publish(),
                // 9. reading waits for a shard behind: not reading, the loop would not see a
                // server that stops and asks for confirmations (its keepalives wait unread),
                // and the catch-up cannot end while the server refuses connections: ask it
                _ = tokio::time::sleep_until(self.state.next_probe), if self.messages_wait() => {
                    self.state.next_probe = Instant::now() + PAUSE_PROBE;
                    self.probe_server().await?;
                }
                // 10. the server said nothing for the whole replication timeout
                _ = tokio::time::sleep_until(self.state.last_heard + silence_limit), if self.reading() => {
                    self.ctx.metrics.replication_silent_total.inc();
                    return Err(RelayError::ReplicationSilent(silence_limit));
                }
            }
        }
    }

    fn on_received(
        &mut self,
        received: Result<Option<ReplicationEvent>, PgWireError>,
    ) -> Result<(), RelayError> {
        match received {
            Ok(Some(event)) => self.on_event(event),
            Ok(None) => Err(RelayError::StreamEnded),
            Err(e) => Err(self.streaming_error(e)),
        }
    }

    fn streaming_error(&self, e: PgWireError) -> RelayError {
        let cfg = &self.ctx.config;
        let recover = cfg.on_lost_slot == OnLostSlot::Recover;
        replication_error(e, ReplicationPhase::Streaming, &cfg.postgres, recover, None)
    }

    fn on_event(&mut self, event: ReplicationEvent) -> Result<(), RelayError> {
        match event {
            ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                xid,
            } => {
                if self.state.open.is_some() {
                    return Err(RelayError::Protocol(format!(
                        "Begin {final_lsn} inside an open transaction"
                    )));
                }
                self.state.open = Some(OpenTransaction {
                    commit_lsn: final_lsn,
                    commit_time_micros,
                    xid,
                    next_seq: 0,
                    messages_seen: 0,
                    messages: Vec::new(),
                    messages_bytes: 0,
                });
            }
            ReplicationEvent::XLogData { data, .. } => match decode::decode(&data)? {
                PgOutput::Relation(relation) => {
                    debug!(relation = %relation.name, id = relation.id, "relation");
                    self.relations.on_relation(&relation)?;
                }
                PgOutput::Insert(insert) => match self.relations.on_insert(insert)? {
                    Row::Outbox(mut event) => {
                        let commit_lsn = self
                            .state
                            .open
                            .as_ref()
                            .ok_or_else(|| {
                                RelayError::Protocol("insert outside a transaction".into())
                            })?
                            .commit_lsn;
                        let shard = self.lane_of(&event, commit_lsn)?;
                        let txn = self.state.open.as_mut().expect("checked above");
                        let id = EntryId {
                            commit_lsn: txn.commit_lsn.as_u64() + self.state.id_offset,
                            seq: txn.next_seq,
                        };
                        txn.next_seq += 1;
                        let layout = &self.state.layout;
                        let span = publish_span(
                            &mut event,
                            id,
                            || layout.base_of(shard),
                            txn.commit_time_micros,
                        );
                        self.state.filling.push(
                            StreamEntry {
                                id,
                                shard,
                                event,
                                commit_time_micros: 0,
                                span,
                                xid: txn.xid,
                                order: None,
                                // Slot-only: the table cannot give it back either.
                                tableless: !self.ctx.config.postgres.outbox.recovers_from_table(),
                            },
                            txn.commit_time_micros,
                        );
                    }
                    Row::Foreign(table) => {
                        self.ctx.metrics.foreign_inserts_skipped_total.inc();
                        debug!(%table, "insert into another table of the publication; not published");
                    }
                },
                PgOutput::Skipped(_) => {}
            },
            ReplicationEvent::Commit { lsn, end_lsn, .. } => {
                let txn =
                    self.state.open.take().ok_or_else(|| {
                        RelayError::Protocol(format!("Commit {lsn} without Begin"))
                    })?;
                if txn.commit_lsn != lsn {
                    return Err(RelayError::Protocol(format!(
                        "Commit {lsn} does not match Begin final_lsn {}",
                        txn.commit_lsn
                    )));
                }
                self.ctx.metrics.transactions_total.inc();
                for (position, event) in txn.messages {
                    let id = EntryId {
                        commit_lsn: txn.commit_lsn.as_u64() + self.state.id_offset,
                        seq: FIRST_MESSAGE_SEQ + position,
                    };
                    self.ctx.metrics.messages_published_total.inc();
                    let shard = self.lane_of(&event, txn.commit_lsn)?;
                    self.state.filling.push(
                        StreamEntry {
                            id,
                            shard,
                            event,
                            commit_time_micros: 0,
                            span: None,
                            xid: txn.xid,
                            order: None,
                            tableless: true,
                        },
                        txn.commit_time_micros,
                    );
                }
                self.state.filling.complete_transaction(end_lsn);
            }
            ReplicationEvent::KeepAlive {
                wal_end,
                reply_requested,
                ..
            } => {
                // Nothing open or unconfirmed: the slot may move to the server's position
                // (recorded in Redis first, like every acknowledgement).
                if self.is_idle() && wal_end > self.state.acknowledged_lsn {
                    let ack = self
                        .state
                        .filling
                        .ack_lsn
                        .map_or(wal_end, |lsn| lsn.max(wal_end));
                    self.state.filling.ack_lsn = Some(ack);
                    if reply_requested {
                        // A stopping server waits for it: no batching delay.
                        self.state.ack_only_not_before = Instant::now();
                    }
                }
                // A server asks after half of wal_sender_timeout without a status (a quiet
                // stream: our worker reports only what is new), and, while it stops, again
                // right after every reply (our worker replies at once): only asks that come
                // back at once are a stopping server's.
                if reply_requested && wal_end > self.state.acknowledged_lsn {
                    let now = Instant::now();
                    let again = self
                        .state
                        .last_ask
                        .is_some_and(|last| now.duration_since(last) <= ASKED_AGAIN_WITHIN);
                    self.state.last_ask = Some(now);
                    if again {
                        let asked = match self.state.confirm_asked {
                            Some((lsn, deadline)) => (lsn.max(wal_end), deadline),
                            None => {
                                debug!(%wal_end, acknowledged = %self.state.acknowledged_lsn, "the server is stopping: it waits for a confirmation");
                                (wal_end, now + self.ctx.config.shutdown_grace)
                            }
                        };
                        self.state.confirm_asked = Some(asked);
                    }
                }
            }
            ReplicationEvent::Message {
                transactional,
                prefix,
                content,
                ..
            } => self.on_message(transactional, prefix, content)?,
            ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    /// The lane of `event`; a route this session has no stream for ends it (the supervisor
    /// registers the route, and the next session, which loads it, gets the row again: nothing
    /// of this transaction was acknowledged).
    fn lane_of(&self, event: &OutboxEvent, commit_lsn: Lsn) -> Result<u32, RelayError> {
        self.state
            .layout
            .lane_of(event.route.as_deref(), event.key.as_deref())
            .map_err(|NewRoute(route)| RelayError::NewRoute {
                route,
                at: commit_lsn.as_u64(),
            })
    }

    /// A logical decoding message: one of the configured prefixes, emitted in a
    /// transaction, becomes an entry at its transaction's Commit.
    fn on_message(
        &mut self,
        transactional: bool,
        prefix: String,
        content: bytes::Bytes,
    ) -> Result<(), RelayError> {
        let wanted = self.ctx.config.message_prefixes.contains(&prefix);
        if !transactional {
            if wanted {
                self.ctx.metrics.messages_skipped_total.inc();
                debug!(%prefix, "a non-transactional message has no place in commit order; not published");
            }
            return Ok(());
        }
        let max_bytes = self.ctx.config.lanes.max_bytes;
        let txn = self.state.open.as_mut().ok_or_else(|| {
            RelayError::Protocol("transactional message outside a transaction".into())
        })?;
        let position = txn.messages_seen;
        txn.messages_seen += 1;
        if !wanted {
            return Ok(());
        }
        // The event type and, when routed, the route.
        let prefix_bytes = bytes::Bytes::from(prefix);
        let event = OutboxEvent {
            // Stable across replays, failovers and rebuilds of the stream: what consumers
            // deduplicate by.
            outbox_id: bytes::Bytes::from(format!("{}:{position}", txn.commit_lsn)),
            event: prefix_bytes.clone(),
            payload: content,
            created_at: None,
            key: None,
            traceparent: None,
            extra: Vec::new(),
            route: Some(prefix_bytes),
        };
        txn.messages_bytes += event.encoded_len();
        if txn.messages_bytes > max_bytes {
            return Err(RelayError::Config(format!(
                "transaction {} emitted more than --lane-max-bytes ({max_bytes}) of logical messages to publish; they are held until its commit: raise --lane-max-bytes",
                txn.commit_lsn
            )));
        }
        txn.messages.push((position, event));
        Ok(())
    }

    fn start_publish(&mut self) {
        let batch = std::mem::take(&mut self.state.filling);
        // With shards, a batch records its acknowledgement in the shards it writes; every
        // live shard gets it at most once per status interval (and with every batch that is
        // only an acknowledgement, or while stopping), which is as often as the slot hears.
        let now = Instant::now();
        let ack_all = self.state.layout.lanes() == 1
            || !batch.has_entries()
            || self.state.finishing
            || now >= self.state.next_ack_all;
        if ack_all && batch.ack_lsn.is_some() {
            self.state.next_ack_all = now + self.ctx.config.status_interval;
        }
        let sealed = self.pipeline.send(batch, ack_all);
        self.after_sealing(sealed);
    }

    fn after_sealing(&mut self, sealed: Sealed) {
        for (shard, consumed) in sealed.behind {
            self.catch_ups.fell_behind(shard, consumed);
        }
        self.ctx
            .metrics
            .lane_held_bytes
            .set(self.pipeline.held_bytes() as i64);
        self.acknowledge_slot();
    }

    fn on_pipeline(&mut self, event: Event) {
        match event {
            Event::Confirmed(confirmed) => self.on_published(confirmed),
            Event::Behind {
                shard,
                reason,
                consumed,
            } => {
                self.ctx
                    .set_last_error(Some(format!("shard {shard} fell behind: {reason}")));
                self.catch_ups.fell_behind(shard, consumed);
            }
        }
        self.ctx
            .metrics
            .lane_held_bytes
            .set(self.pipeline.held_bytes() as i64);
        self.acknowledge_slot();
    }

    fn on_handover(&mut self, request: Handover) -> Result<(), RelayError> {
        match request {
            Handover::Capture { shards, started } => {
                self.state.pending_capture = Some((shards, started));
            }
            Handover::Rejoin {
                shard,
                top,
                watermark,
                done,
            } => {
                let rejoined =
                    self.pipeline
                        .rejoin(shard, top, watermark, self.state.acknowledged_lsn);
                let _ = done.send(rejoined);
                self.acknowledge_slot();
            }
            Handover::Abandon { shards } => {
                // A capture asked for and not begun yet is no longer wanted either.
                if self
                    .state
                    .pending_capture
                    .as_ref()
                    .is_some_and(|(pending, _)| pending.iter().any(|k| shards.contains(k)))
                {
                    self.state.pending_capture = None;
                }
                self.pipeline.abandon_capture(&shards)
            }
            Handover::Failed(e) => return Err(e),
        }
        Ok(())
    }

    /// Capture what is sealed for the shards a catch-up hands over, from this transaction
    /// boundary on (everything of a transaction begun later is kept, so none is half lost).
    fn begin_capture(&mut self) {
        if let Some((shards, started)) = self.state.pending_capture.take() {
            self.pipeline.start_capture(&shards);
            // Everything dropped before this point: the hand-over's last snapshot must show it.
            let _ = started.send(self.pipeline.unseen(&shards));
        }
    }

    fn on_published(&mut self, confirmed: Confirmed) {
        let outcome = confirmed.outcome;
        let metrics = &self.ctx.metrics;
        metrics.events_published_total.inc_by(outcome.published);
        metrics.duplicates_rejected_total.inc_by(outcome.duplicates);
        metrics.publish_batches_total.inc();
        metrics
            .publish_batch_entries
            .observe(confirmed.entries as f64);
        let now_pg_micros = unix_micros() - PG_EPOCH_OFFSET_MICROS;
        for commit_time in &confirmed.commit_times_micros {
            let latency = (now_pg_micros - commit_time).max(0) as f64 / 1e6;
            metrics.commit_to_published_seconds.observe(latency);
        }
        if outcome.duplicates > 0 {
            debug!(
                shard = confirmed.shard,
                duplicates = outcome.duplicates,
                "stream already held re-sent entries"
            );
        }
    }

    /// Acknowledge the slot as far as every live shard recorded (or, with none live, as far
    /// as anything was sealed).
    fn acknowledge_slot(&mut self) {
        if let Some(lsn) = self.pipeline.slot_ack() {
            self.acknowledge(lsn);
        }
    }

    fn acknowledge(&mut self, lsn: Lsn) {
        if lsn > self.state.acknowledged_lsn {
            self.client.update_applied_lsn(lsn);
            self.state.acknowledged_lsn = lsn;
            self.ctx.metrics.acknowledged_lsn.set(lsn.as_u64() as i64);
            if self
                .state
                .confirm_asked
                .is_some_and(|(asked, _)| lsn >= asked)
            {
                self.state.confirm_asked = None;
            }
        }
    }

    /// When a confirmation the server asked for is overdue: it had the shutdown grace, the
    /// bound a stopping relay gives its own healthy shards. (Without one the branch is off
    /// and any instant does.)
    fn confirm_deadline(&self) -> Instant {
        self.state
            .confirm_asked
            .map_or(self.state.last_heard, |(_, deadline)| deadline)
    }

    fn confirmation_overdue(&self) -> RelayError {
        let (asked, _) = self
            .state
            .confirm_asked
            .expect("a confirmation was asked for");
        self.ctx.metrics.confirmations_overdue_total.inc();
        RelayError::ConfirmationOverdue {
            asked: asked.to_string(),
            acknowledged: self.state.acknowledged_lsn.to_string(),
            waited: self.ctx.config.shutdown_grace,
        }
    }

    /// Graceful end: publish what was received to the shards that confirm (bounded by the
    /// shutdown grace; a shard that cannot confirm is not waited for), send the last
    /// acknowledgement, wait until it was written to the server, then stop.
    async fn finish(&mut self) -> Result<(), RelayError> {
        self.ctx.set_role(Role::Stopping);
        self.state.finishing = true;
        let cfg = &self.ctx.config;
        let deadline = Instant::now() + cfg.shutdown_grace;
        // The open transaction (if any) is dropped: Postgres re-sends it next time.
        self.pipeline.drop_failing();
        let mut levelled = false;
        loop {
            if self.ready_to_publish() || self.ack_only_waiting() {
                self.start_publish();
            }
            if self.pipeline.healthy_idle() {
                // Shards that last recorded an older acknowledgement hold the slot back:
                // every batch is confirmed now, so one acknowledgement-only part to each of
                // them lets the slot move to the newest.
                let newest = self.pipeline.newest_ack();
                if !levelled && newest.is_some_and(|n| n > self.state.acknowledged_lsn) {
                    levelled = true;
                    self.pipeline.acknowledge_healthy(newest.expect("checked"));
                    continue;
                }
                break;
            }
            match tokio::time::timeout_at(deadline, self.pipeline.next_event()).await {
                Ok(Ok(Event::Confirmed(confirmed))) => {
                    self.on_published(confirmed);
                    self.acknowledge_slot();
                }
                // Not caught up now: the next session does.
                Ok(Ok(Event::Behind { .. })) => self.acknowledge_slot(),
                Ok(Err(e)) => {
                    warn!(error = %e, "publishing failed during shutdown; the rest stays unacknowledged");
                    break;
                }
                Err(_) => {
                    warn!(grace = ?cfg.shutdown_grace, "unconfirmed calls left at the end of the shutdown grace; they stay unacknowledged");
                    break;
                }
            }
        }
        self.acknowledge_slot();
        self.pipeline.abort();
        // pgwire-replication sends no final status on stop(): wait until the worker reports
        // that a status update carrying our last acknowledgement went out.
        let target = self.state.acknowledged_lsn;
        let metrics = self.client.metrics();
        let ack_deadline = Instant::now() + cfg.status_interval * 2 + Duration::from_secs(1);
        while metrics.last_applied_lsn() < target && Instant::now() < ack_deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let sent = metrics.last_applied_lsn();
        if sent < target {
            warn!(acknowledged = %target, sent = %sent, "last acknowledgement not confirmed as sent before stopping");
        }
        match tokio::time::timeout(Duration::from_secs(2), self.client.shutdown()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => debug!(error = %e, "replication stream closed with an error"),
            Err(_) => warn!("replication stream did not close within 2 s"),
        }
        info!(acknowledged_lsn = %sent, "stopped");
        Ok(())
    }
}

/// The relay's span of an entry whose row carries trace context: a child of the sending
/// request's span, from the transaction's commit (Postgres's clock) to Redis confirming
/// the entry. The entry then carries the span's own context, so the receiver's spans hang
/// below it. Without spans (or trace context) the row's context passes on unchanged.
fn publish_span(
    event: &mut OutboxEvent,
    id: EntryId,
    stream: impl FnOnce() -> String,
    commit_time_micros: i64,
) -> Option<PublishSpan> {
    use outbox_core::telemetry::{self, Attribute, Kind};
    if !telemetry::enabled() {
        return None;
    }
    let parent = telemetry::parse(std::str::from_utf8(event.traceparent.as_deref()?).ok()?)?;
    let committed = std::time::UNIX_EPOCH
        .checked_add(Duration::from_micros(
            (commit_time_micros + PG_EPOCH_OFFSET_MICROS).max(0) as u64,
        ))
        .filter(|t| *t <= std::time::SystemTime::now());
    let span = telemetry::start(
        "outbox publish",
        Kind::Producer,
        Some(&parent),
        committed,
        vec![
            Attribute::new("messaging.system", "redis"),
            Attribute::new("messaging.operation.type", "publish"),
            Attribute::new("messaging.destination.name", stream()),
            Attribute::new("messaging.message.id", id.to_string()),
            Attribute::new(
                "outbox.id",
                String::from_utf8_lossy(&event.outbox_id).into_owned(),
            ),
        ],
    )?;
    event.traceparent = telemetry::passed_on(Some(&span), Some(&parent)).map(Into::into);
    Some(PublishSpan::new(span))
}

fn unix_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or_default()
}
