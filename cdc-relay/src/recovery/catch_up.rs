//! Catching a shard up from the outbox table: the durable buffer behind the slot.
//!
//! A shard that fell behind (its lane could not confirm for `--shard-detach-after`, its
//! stream was full, it lost data, or it was behind when the session started) no longer holds
//! the slot back; its record still says how far it got. This task publishes what the outbox
//! table owes it, at the pace its consumer groups read, and hands it back to live streaming:
//!
//! 1. [`prepare`]: read the shard's record and decide what to compare: the rows its
//!    `watermark` does not show (`since`), or every retained row when the shard lost what it
//!    held, its record, or never had a watermark (`everything`); claim the shard for this
//!    session and mark the record, so a catch-up cut short resumes the same way.
//! 2. [`Present`]: the entries the shard may already hold of those rows (from its
//!    `watermark_from` on, or all of them), copied into a temporary table page by page.
//! 3. Rounds ([`CatchUp::round`]): the rows a snapshot shows and the previous one (or the
//!    shard's watermark) does not, not present, of the shards in the group, in outbox id
//!    order, each published into its shard above its top, a chunk at a time, fenced. Each
//!    round's snapshot is a value in the query (`pg_visible_in_snapshot`), never a held
//!    transaction: vacuum is never held back, and the stream itself is the progress mark.
//! 4. Hand-over ([`CatchUp::hand_over`]) once a round is short: the streaming loop starts
//!    keeping (capturing) what it seals for the shards at its next transaction boundary, a
//!    last snapshot is taken (once it shows every transaction the loop dropped before: a
//!    commit is sent by the slot a moment before snapshots show it) and its round published, the record gets that snapshot as its
//!    watermark (the marker goes), and the loop turns each shard live, releasing the captured
//!    transactions the last snapshot does not show (they committed after it; every other one
//!    it shows, and the round published it). A transaction the snapshot shows may still be
//!    on its way to the loop (the slot's stream lags the server): the lane holds the last
//!    snapshot until the slot passes it, and drops what it shows when it arrives.
//!
//! Order: rows of one round go in outbox id order, which agrees with commit order for any two
//! transactions one of which began after the other committed (the id is taken from a
//! sequence at insert), so for writers that serialise per key before inserting (the chat's
//! feed counter) per-key order holds; rounds follow snapshots, so a later round's rows
//! committed after every earlier round's. Live entries after the hand-over committed after the
//! last snapshot. Ids: each shard continues above its top (`<top lsn>-<seq + n>`), below
//! every live id that follows (those are later commit LSNs). The slot may not have been
//! acknowledged past the rows a round published when the session ends: the next session
//! receives them again, and their live ids would land below the top where nothing was ever
//! written. The shard's recorded watermark shows them, so they are not sent (`Lane::holds`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::backoff::Backoff;
use outbox_core::stream::EntryId;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::Client;
use tracing::{debug, info, warn};

use super::decide::{shard_history, ShardHistory};
use crate::context::SharedContext;
use crate::decode::{rfc3339_utc, stored_payload, OutboxEvent, OutboxMapping, BYTEA_OID};
use crate::error::RelayError;
use crate::sink::{
    NewRecord, PartMeta, Publisher, Records, StreamEntry, StreamRecord, CATCH_UP_EVERYTHING,
    CATCH_UP_SINCE,
};
use crate::source::{take_watermark, wait_durable, Origin, Snapshot, Watermark, Watermarks};

/// Rows a query looks at, at most (it returns at most `--batch-max-bytes` of them).
const CHUNK: usize = 1000;
/// Bytes of stream entries read per page when copying what a shard holds: with entries of
/// at most `--max-row-bytes`, so many bytes at most.
const PAGE_BYTES: usize = 16 << 20;
/// A round that published at most this many rows is short enough to hand over after.
const SHORT_ROUND: u64 = 200;
/// How often a catch-up waiting for the consumer groups looks again.
const ROOM_POLL: Duration = Duration::from_millis(200);
/// How long a catch-up waits for one shard's consumers before giving way to other shards
/// behind (each of its turns costs a comparison, so not much shorter).
const ROOM_WAIT_WHEN_OTHERS_WAIT: Duration = Duration::from_secs(10);
/// How long a hand-over waits for the transactions its lanes dropped to become visible
/// before it gives up its capture (the catch-up tries again after a backoff).
const COMMITS_WAIT: Duration = Duration::from_secs(10);
/// Deadline of each step against Redis and each query against Postgres.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// What the streaming loop is asked to do for a catch-up.
pub(crate) enum Handover {
    /// Keep what is sealed for `shards` from the next transaction boundary on; answer once
    /// it does, with the xids of the transactions lanes dropped that no watermark has shown
    /// yet (the last snapshot must show them: they were sent before the capture began).
    Capture {
        shards: Vec<u32>,
        started: oneshot::Sender<Vec<u32>>,
    },
    /// `shard` holds every row `watermark` shows, and its last id is `top`: turn it live.
    /// The answer is whether it did (`false`: its capture was lost; the catch-up goes on).
    Rejoin {
        shard: u32,
        top: Option<EntryId>,
        watermark: Arc<Watermark>,
        done: oneshot::Sender<bool>,
    },
    /// Drop what `shards` captured.
    Abandon { shards: Vec<u32> },
    /// A catch-up met an error that needs a human (another cluster's stream, a resized one):
    /// the session ends with it.
    Failed(RelayError),
}

/// The catch-up task of a session: told which shards fall behind, it catches them up and
/// hands them back. Dropped with the session (which aborts it: what it published stays, and
/// the next session's catch-up compares with it).
pub(crate) struct CatchUps {
    behind: mpsc::UnboundedSender<(u32, Option<Arc<Watermark>>)>,
    task: JoinHandle<()>,
}

impl CatchUps {
    pub(crate) fn spawn(
        ctx: SharedContext,
        publisher: Publisher,
        origin: Origin,
        watermarks: Watermarks,
        handover: mpsc::Sender<Handover>,
        behind_at_start: &[u32],
    ) -> Self {
        let (behind, behind_rx) = mpsc::unbounded_channel();
        for k in 0..publisher.shard_count() {
            ctx.metrics
                .shard_behind
                .with_label_values(&[&publisher.layout().label(k)])
                .set(i64::from(behind_at_start.contains(&k)));
        }
        ctx.set_behind_shards(behind_at_start.to_vec());
        for &k in behind_at_start {
            let _ = behind.send((k, None));
        }
        let manager = Manager {
            ctx,
            publisher,
            origin,
            watermarks,
            handover,
        };
        let task = tokio::spawn(manager.run(behind_rx));
        Self { behind, task }
    }

    /// `shard` fell behind; `consumed`: a watermark every row of which its groups had
    /// acknowledged (what it owes, should its data be gone, is only what that does not show).
    /// (The streaming loop calls this as the lane falls behind, so the gauge says so at once.)
    pub(crate) fn fell_behind(&self, shard: u32, consumed: Option<Arc<Watermark>>) {
        let _ = self.behind.send((shard, consumed));
    }
}

impl Drop for CatchUps {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One behind shard waiting for its turn.
struct Waiting {
    next_try: Instant,
    backoff: Backoff,
    /// Its catch-up was cut short (it failed, or its stream is full): say so once.
    said: bool,
    /// What its groups had consumed when it fell behind.
    consumed: Option<Arc<Watermark>>,
}

struct Manager {
    ctx: SharedContext,
    publisher: Publisher,
    origin: Origin,
    watermarks: Watermarks,
    handover: mpsc::Sender<Handover>,
}

impl Manager {
    async fn run(self, mut behind_rx: mpsc::UnboundedReceiver<(u32, Option<Arc<Watermark>>)>) {
        let mut waiting: BTreeMap<u32, Waiting> = BTreeMap::new();
        let max_backoff = self
            .ctx
            .config
            .reconnect_max_backoff
            .max(Duration::from_secs(1));
        loop {
            let next = waiting.values().map(|w| w.next_try).min();
            tokio::select! {
                biased;
                shard = behind_rx.recv() => match shard {
                    Some((k, consumed)) => {
                        let w = waiting.entry(k).or_insert_with(|| Waiting {
                            next_try: Instant::now(),
                            backoff: Backoff::new(Duration::from_millis(200), max_backoff),
                            said: false,
                            consumed: None,
                        });
                        if consumed.is_some() {
                            w.consumed = consumed;
                        }
                        self.export(&waiting);
                    }
                    None => return,
                },
                _ = sleep_until_opt(next) => {
                    // Everything behind and due goes as one group: one pass over the table.
                    let now = Instant::now();
                    let due: Vec<u32> = waiting
                        .iter()
                        .filter(|(_, w)| w.next_try <= now)
                        .map(|(k, _)| *k)
                        .collect();
                    let due: Vec<(u32, Option<Arc<Watermark>>)> = due
                        .into_iter()
                        .map(|k| (k, waiting[&k].consumed.clone()))
                        .collect();
                    // Others waiting: a shard whose consumers do not read gives way to them.
                    let others_wait = waiting.len() > 1;
                    let outcome = self.catch_up(&due, others_wait).await;
                    for k in &outcome.again {
                        if let Some(w) = waiting.get_mut(k) {
                            w.next_try = Instant::now();
                        }
                    }
                    for k in outcome.rejoined {
                        waiting.remove(&k);
                        self.ctx
                            .metrics
                            .shard_behind_seconds
                            .with_label_values(&[&self.publisher.layout().label(k)])
                            .set(0.0);
                    }
                    for (k, why) in outcome.later {
                        if let Some(w) = waiting.get_mut(&k) {
                            let delay = w.backoff.next_delay();
                            w.next_try = Instant::now() + delay;
                            if !w.said {
                                warn!(shard = k, error = %why, retry_in = ?delay, "catching the shard up from the outbox table must wait");
                                w.said = true;
                            } else {
                                debug!(shard = k, error = %why, retry_in = ?delay, "catch-up waits");
                            }
                        }
                    }
                    if let Some(e) = outcome.fatal {
                        let _ = self.handover.send(Handover::Failed(e)).await;
                        return;
                    }
                    self.export(&waiting);
                }
            }
        }
    }

    fn export(&self, waiting: &BTreeMap<u32, Waiting>) {
        self.ctx
            .set_behind_shards(waiting.keys().copied().collect());
        let metrics = &self.ctx.metrics;
        for k in 0..self.publisher.shard_count() {
            metrics
                .shard_behind
                .with_label_values(&[&self.publisher.layout().label(k)])
                .set(i64::from(waiting.contains_key(&k)));
        }
    }

    /// Catch the shards `due` up as one group; which rejoined, which must wait (and why),
    /// and an error that ends the session.
    async fn catch_up(&self, due: &[(u32, Option<Arc<Watermark>>)], others_wait: bool) -> Outcome {
        let mut outcome = Outcome::default();
        let mut group = Vec::new();
        for (k, consumed) in due {
            let k = *k;
            let prepared = prepare(
                &self.ctx,
                &self.publisher,
                &self.origin,
                k,
                consumed.as_deref(),
            );
            match tokio::time::timeout(STEP_TIMEOUT, prepared).await {
                Ok(Ok(prepared)) => group.push(prepared),
                Ok(Err(e)) if e.is_transient() => outcome.later.push((k, e.to_string())),
                Ok(Err(e)) => {
                    outcome.fatal = Some(e);
                    return outcome;
                }
                Err(_) => outcome
                    .later
                    .push((k, format!("no answer within {STEP_TIMEOUT:?}"))),
            }
        }
        if group.is_empty() {
            return outcome;
        }
        // A shard whose earlier catch-up stopped midway goes on from its cursor, in a group of
        // its own (its first round is that cursor's snapshot); the others wait for the next turn.
        if let Some(at) = group.iter().position(|p| p.cursor.is_some()) {
            let resumed = group.swap_remove(at);
            for other in group.drain(..) {
                outcome
                    .later
                    .push((other.shard, "another shard's catch-up goes first".into()));
            }
            group.push(resumed);
        }
        let shards: Vec<u32> = group.iter().map(|p| p.shard).collect();
        let mut run = CatchUp {
            ctx: &self.ctx,
            publisher: self.publisher.clone(),
            origin: &self.origin,
            watermarks: &self.watermarks,
            handover: &self.handover,
            shards: group.into_iter().map(|p| (p.shard, p)).collect(),
            published: 0,
            rejoined: Vec::new(),
            gives_way: others_wait.then_some(ROOM_WAIT_WHEN_OTHERS_WAIT),
            full: None,
        };
        let ran = run.run().await;
        // Shards that turned live before an error stay live: never abandoned, re-queued or
        // caught up again while their lane streams.
        let rejoined = std::mem::take(&mut run.rejoined);
        let full = run.full;
        let rest: Vec<u32> = shards
            .iter()
            .copied()
            .filter(|k| !rejoined.contains(k))
            .collect();
        match ran {
            Ok(()) => {
                for k in &rest {
                    outcome
                        .later
                        .push((*k, "its capture was lost during the hand-over".into()));
                }
            }
            Err(e) => {
                let _ = self
                    .handover
                    .send(Handover::Abandon {
                        shards: rest.clone(),
                    })
                    .await;
                if e.is_transient() || matches!(e, RelayError::StreamFull { .. }) {
                    for k in rest {
                        match full {
                            // The shard that waited for its consumers waits its turn; the
                            // others of its group go again at once, without it.
                            Some(f) if f != k => outcome.again.push(k),
                            _ => outcome.later.push((k, e.to_string())),
                        }
                    }
                } else {
                    outcome.fatal = Some(e);
                }
            }
        }
        outcome.rejoined = rejoined;
        outcome
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[derive(Default)]
struct Outcome {
    rejoined: Vec<u32>,
    later: Vec<(u32, String)>,
    /// Shards to try again at once (another shard of their group was the one that waited).
    again: Vec<u32>,
    fatal: Option<RelayError>,
}

/// What a shard's catch-up compares with the outbox.
#[derive(Debug, Clone)]
enum Mode {
    /// The rows `watermark` does not show; entries from `from` on may hold some.
    Since { watermark: Watermark, from: EntryId },
    /// Every retained row; any entry may hold one.
    Everything,
}

/// A shard ready to be caught up.
struct Prepared {
    shard: u32,
    mode: Mode,
    /// Its last id now (the next entries go above it).
    top: EntryId,
    /// What an earlier catch-up of it put in the shard: every row this snapshot shows.
    done: Option<Snapshot>,
    /// ... and every row this snapshot shows up to this outbox id.
    cursor: Option<(Snapshot, i64)>,
    /// Counted as behind longer than `--outbox-retention` (once per catch-up).
    past_retention: bool,
}

impl Prepared {
    /// How long ago the shard fell behind, exported; past `--outbox-retention` (checked at
    /// the start and as a long catch-up goes on: the table's cleanup does not wait for it),
    /// counted and said once.
    fn check_age(&mut self, ctx: &SharedContext) {
        let Mode::Since { watermark, .. } = &self.mode else {
            return;
        };
        let age = watermark.age();
        ctx.metrics
            .shard_behind_seconds
            .with_label_values(&[&ctx.layout().label(self.shard)])
            .set(age.as_secs_f64());
        let retention = ctx.config.outbox_retention;
        if age > retention && !self.past_retention {
            // Rows older than the services' retention may have been deleted before this
            // shard got them: the one way this design loses a message. Counted and said.
            self.past_retention = true;
            ctx.metrics.catch_up_past_retention_total.inc();
            tracing::error!(shard = self.shard, behind_for = ?age, ?retention, "the shard fell behind longer ago than --outbox-retention: rows it never got may have been deleted from the outbox table");
        }
    }
}

/// Step 1: read `shard`'s record, decide what to compare, claim the shard, mark the record.
/// `consumed`: a watermark every row of which its groups acknowledged (the bound when the
/// shard lost what it held).
async fn prepare(
    ctx: &SharedContext,
    publisher: &Publisher,
    origin: &Origin,
    shard: u32,
    consumed: Option<&Watermark>,
) -> Result<Prepared, RelayError> {
    let mut publisher = publisher.clone();
    let mut records = publisher.records_of(shard);
    let record = records.read().await?;
    // Whatever the shard still holds, when it lost entries: compared from its start.
    let everything_present = EntryId {
        commit_lsn: 0,
        seq: 1,
    };
    let mut same_history = true;
    let mode = if !record.exists() {
        // Redis lost the shard's record (and so what it held): every retained row, or those
        // its groups had not consumed. Made with this relay's offset (its top is gone with
        // it) and the marker.
        records
            .create(&NewRecord {
                origin,
                shards: publisher.layout().shards(),
                acked_through: 0,
                id_offset: publisher.id_offset(),
                last_id: None,
                watermark: consumed,
                rebuilding: Some(if consumed.is_some() {
                    CATCH_UP_SINCE
                } else {
                    CATCH_UP_EVERYTHING
                }),
            })
            .await?;
        match consumed {
            Some(w) => Mode::Since {
                watermark: w.clone(),
                from: everything_present,
            },
            None => Mode::Everything,
        }
    } else {
        same_history = check_identity(&record, origin, &publisher, &mut records).await?;
        let intact =
            record.watermark.is_some() && record.watermark_from.is_some() && !record.lost_entries();
        match (&record.watermark, record.watermark_from) {
            (Some(w), Some(from)) if same_history && intact && !record.catching_up_everything() => {
                Mode::Since {
                    watermark: w.clone(),
                    from,
                }
            }
            _ if same_history && !intact && consumed.is_some() => {
                // It lost entries: only what its groups had not consumed is owed, and the
                // record says so before anything is published (a catch-up cut short resumes
                // from it).
                let w = consumed.expect("checked").clone();
                records.set_watermark(&w, everything_present).await?;
                Mode::Since {
                    watermark: w,
                    from: everything_present,
                }
            }
            _ => Mode::Everything,
        }
    };
    // Claimed before anything is written: a session that held the shard before (paused,
    // retrying an old part) is refused from now on.
    publisher
        .claim_writer_epoch(shard, &ctx.config.postgres.slot)
        .await?;
    let marker = match mode {
        Mode::Since { .. } => CATCH_UP_SINCE,
        Mode::Everything => CATCH_UP_EVERYTHING,
    };
    if record.rebuilding.as_deref() != Some(marker) {
        records.set_marker(marker).await?;
    }
    ctx.metrics
        .catch_ups_total
        .with_label_values(&[marker])
        .inc();
    let (top, _) = records.top_and_len().await?;
    info!(shard, stream = %publisher.shard_stream(shard), mode = marker, %top, "catching the shard up from the outbox table");
    // What an earlier catch-up did counts only while the shard holds it and the snapshots
    // are this history's.
    let (done, cursor) = if record.exists() && !record.lost_entries() && same_history {
        (record.catch_up_done.clone(), record.catch_up_cursor.clone())
    } else {
        if record.catch_up_done.is_some() || record.catch_up_cursor.is_some() {
            records.clear_progress().await?;
        }
        (None, None)
    };
    if let Some((_, id)) = &cursor {
        info!(
            shard,
            after_outbox_id = id,
            "an earlier catch-up of the shard stopped midway: going on from there"
        );
    }
    let mut prepared = Prepared {
        shard,
        mode,
        top,
        done,
        cursor,
        past_retention: false,
    };
    prepared.check_age(ctx);
    Ok(prepared)
}

/// The record must be this cluster's, of this layout, on this history or a later one
/// (recorded now); whether it was this very history (on another, its watermark's
/// transactions are not the server's: every retained row is compared).
async fn check_identity(
    record: &StreamRecord,
    origin: &Origin,
    publisher: &Publisher,
    records: &mut Records,
) -> Result<bool, RelayError> {
    if record.system_id.as_deref() != Some(origin.system_id.as_str()) {
        return Err(RelayError::OriginMismatch {
            stream: publisher.stream().to_string(),
            stream_system: record.system_id.clone().unwrap_or_default(),
            server_system: origin.system_id.clone(),
        });
    }
    if record.shards != Some(publisher.layout().shards()) {
        return Err(RelayError::Config(format!(
            "stream {} states {} shard(s), this relay writes {}: restart it with the stream's --stream-shards",
            publisher.stream(),
            record.shards.map_or("an unreadable number of".into(), |n| n.to_string()),
            publisher.layout().shards()
        )));
    }
    match shard_history(record, origin) {
        ShardHistory::Same => Ok(true),
        history @ (ShardHistory::Later | ShardHistory::Forked) => {
            // A later timeline agrees with the record's up to its switch point; a fork,
            // nowhere that can be trusted.
            let agrees_through = match history {
                ShardHistory::Later => origin.history.agrees_through(record.timeline),
                _ => 0,
            };
            records.adopt_timeline(origin, agrees_through).await?;
            Ok(false)
        }
        ShardHistory::Older => Err(RelayError::OlderTimeline {
            stream: publisher.stream().to_string(),
            recorded: record.timeline.unwrap_or_default(),
            server: origin.timeline,
        }),
    }
}

/// One catch-up of a group of shards.
struct CatchUp<'a> {
    ctx: &'a SharedContext,
    publisher: Publisher,
    origin: &'a Origin,
    watermarks: &'a Watermarks,
    handover: &'a mpsc::Sender<Handover>,
    shards: HashMap<u32, Prepared>,
    published: u64,
    /// The shards turned live so far (the hand-over turns them one by one).
    rejoined: Vec<u32>,
    /// How long a shard may wait for its consumers to make room before the catch-up gives
    /// way to other shards (`None`: as long as it takes).
    gives_way: Option<Duration>,
    /// The shard that gave way.
    full: Option<u32>,
}

impl CatchUp<'_> {
    /// Steps 2 to 4; the shards that turned live are in `rejoined`.
    async fn run(&mut self) -> Result<(), RelayError> {
        let cfg = &self.ctx.config;
        let sql = cfg.postgres.endpoint.connect(cfg.connect_timeout).await?;
        if !cfg.postgres.outbox.recovers_from_table() {
            // Slot-only: no table to read; what the shards lost is lost, and what the slot
            // sent them since is kept by their lanes (every entry is tableless), released
            // once they are live again.
            warn!(shards = ?self.shards.keys().collect::<Vec<_>>(), "--outbox-recovery slot-only: the shards go live again with nothing brought back; entries their streams lost are lost");
            let hi = self.snapshot(&sql).await?;
            return self.hand_over(&sql, None, hi).await;
        }
        sql.batch_execute(&format!(
            "SET statement_timeout = '{}s'; SET DateStyle = ISO; SET TimeZone = 'UTC';
             CREATE TEMPORARY TABLE IF NOT EXISTS cdc_relay_present (id text, created_at timestamptz);
             TRUNCATE cdc_relay_present",
            STEP_TIMEOUT.as_secs()
        ))
        .await?;
        self.copy_present(&sql).await?;
        sql.batch_execute("CREATE INDEX ON cdc_relay_present (id); ANALYZE cdc_relay_present")
            .await?;
        let table = Table::of(&sql, self.ctx).await?;
        // Round 1 from each shard's own bound (a shard going on from an earlier catch-up's
        // cursor: that cursor's snapshot, after its id), then from each round's snapshot.
        let resumed = self.shards.values().find_map(|p| p.cursor.clone());
        let (mut hi, start_after) = match resumed {
            Some((snapshot, id)) => (
                Arc::new(Watermark {
                    lo: pgwire_replication::Lsn(0),
                    hi: pgwire_replication::Lsn(0),
                    taken_at_micros: 0,
                    snapshot,
                }),
                Some(id),
            ),
            None => (self.snapshot(&sql).await?, None),
        };
        let mut published = self.round(&sql, &table, None, &hi, start_after).await?;
        loop {
            if published <= SHORT_ROUND {
                return self.hand_over(&sql, Some(&table), hi).await;
            }
            let next = self.snapshot(&sql).await?;
            published = self
                .round(&sql, &table, Some(&hi.snapshot), &next, None)
                .await?;
            hi = next;
        }
    }

    /// A watermark, taken on the catch-up's connection.
    async fn snapshot(&self, sql: &Client) -> Result<Arc<Watermark>, RelayError> {
        Ok(Arc::new(take_watermark(sql).await?))
    }

    /// Step 2: every shard's entries that may hold rows it compares, into the temporary table.
    async fn copy_present(&mut self, sql: &Client) -> Result<(), RelayError> {
        let insert = sql
            .prepare(
                "INSERT INTO cdc_relay_present
                 SELECT * FROM unnest($1::text[], $2::text[]::timestamptz[])",
            )
            .await?;
        for prepared in self.shards.values() {
            let mut records = self.publisher.records_of(prepared.shard);
            let mut start = match &prepared.mode {
                Mode::Since { from, .. } => from.to_string(),
                Mode::Everything => "-".to_string(),
            };
            loop {
                let page = (PAGE_BYTES / self.ctx.config.max_row_bytes).clamp(1, 1000);
                let ((ids, created), last) = records.outbox_ids_page(&start, page).await?;
                if !ids.is_empty() {
                    sql.execute(&insert, &[&ids, &created]).await?;
                }
                match last {
                    Some(last) => start = format!("({last}"),
                    None => break,
                }
            }
        }
        Ok(())
    }

    /// Step 3: one round (after `start_after`, an outbox id, when given); how many rows it
    /// published. Each call records its progress in the shard's record: every row `hi` shows
    /// up to the call's last row is in the shard, and every row `lo` (or, in the first round,
    /// the shard's earlier catch-up) shows.
    async fn round(
        &mut self,
        sql: &Client,
        table: &Table,
        lo: Option<&Snapshot>,
        hi: &Watermark,
        start_after: Option<i64>,
    ) -> Result<u64, RelayError> {
        for prepared in self.shards.values_mut() {
            prepared.check_age(self.ctx);
        }
        let lowest = self.lowest_xmin(lo);
        let mut cursor: i64 = match lowest {
            Some(xmin) => {
                // Only rows of transactions from the oldest running at the lower bound on can
                // be missing: start at the least id among them (the `tx` index finds it).
                let row = sql
                    .query_one(
                        &table.min_id(),
                        &[&xmin.to_string(), &hi.snapshot.to_string()],
                    )
                    .await?;
                match row.get::<_, Option<i64>>(0) {
                    Some(id) => id - 1,
                    None => return Ok(0),
                }
            }
            None => i64::MIN,
        };
        if let Some(after) = start_after {
            cursor = cursor.max(after);
        }
        let select = sql.prepare(&table.select(lowest.is_some())).await?;
        let lo_text = lo.map(|s| s.to_string());
        let mut published = 0u64;
        // How many rows a query looks at: as many as fit in a batch at the largest row seen
        // (at first, at the largest row allowed), so the server's work per query is bounded
        // too; the query itself returns no more than a batch's bytes.
        let max_bytes = self.ctx.config.batch.max_bytes;
        let mut look_at = (max_bytes / self.ctx.config.max_row_bytes).clamp(1, CHUNK);
        let mut largest_row = 0usize;
        loop {
            let rows = sql
                .query(
                    &select,
                    &[
                        &cursor,
                        &lowest.map(|x| x.to_string()),
                        &hi.snapshot.to_string(),
                        &lo_text,
                        &(look_at as i64),
                        &(max_bytes as i64),
                    ],
                )
                .await?;
            let Some(last) = rows.last() else { break };
            cursor = last.get(0);
            for row in &rows {
                let len = |i: usize| row.get::<_, Option<String>>(i).map_or(0, |t| t.len());
                largest_row = largest_row.max(len(2) + len(3));
            }
            look_at = (max_bytes / largest_row.max(1)).clamp(1, CHUNK);
            let mut parts: BTreeMap<u32, Vec<StreamEntry>> = BTreeMap::new();
            for row in &rows {
                let event = table.event(row);
                // A route this session does not have: its rows wait for the session that
                // loads it (the slot brings the route, and its lanes start behind).
                let Ok(shard) = self
                    .publisher
                    .layout()
                    .lane_of(event.route.as_deref(), event.key.as_deref())
                else {
                    continue;
                };
                let Some(prepared) = self.shards.get_mut(&shard) else {
                    continue;
                };
                let tx: Option<u64> = row.get::<_, Option<String>>(6).and_then(|t| t.parse().ok());
                if lo.is_none() {
                    if let Mode::Since { watermark, .. } = &prepared.mode {
                        // Shown by the shard's watermark: in the stream, or consumed.
                        if tx.is_none_or(|tx| watermark.snapshot.visible(tx)) {
                            continue;
                        }
                    }
                    // Put in the shard by an earlier catch-up of it.
                    if let Some(done) = &prepared.done {
                        if tx.is_none_or(|tx| done.visible(tx)) {
                            continue;
                        }
                    }
                }
                prepared.top.seq += 1;
                parts.entry(shard).or_default().push(StreamEntry {
                    id: prepared.top,
                    shard,
                    commit_time_micros: 0,
                    order: Some(row.get(0)),
                    event,
                    span: None,
                    xid: 0,
                    tableless: false,
                });
            }
            for (shard, entries) in parts {
                published += entries.len() as u64;
                let done = match lo {
                    Some(lo) => Some(lo.to_string()),
                    None => self.shards[&shard].done.as_ref().map(|d| d.to_string()),
                };
                let meta = PartMeta {
                    done,
                    ..PartMeta::default()
                };
                self.publish(shard, entries, meta, Some(&hi.snapshot))
                    .await?;
            }
        }
        self.published += published;
        Ok(published)
    }

    /// The oldest transaction a round's lower bound (`lo`, or in the first round each
    /// shard's watermark) leaves unfinished (`None`: no bound for some shard; every retained
    /// row is a candidate).
    fn lowest_xmin(&self, lo: Option<&Snapshot>) -> Option<u64> {
        if let Some(lo) = lo {
            return Some(lo.xmin);
        }
        self.shards
            .values()
            .map(|p| match &p.mode {
                Mode::Since { watermark, .. } => Some(watermark.snapshot.xmin),
                Mode::Everything => None,
            })
            .collect::<Option<Vec<u64>>>()?
            .into_iter()
            .min()
    }

    /// Publish `entries` into `shard` above its top, fenced there, once its groups have left
    /// room for them (an empty list: one call that records only `meta`). With `progress`
    /// (the round's snapshot), each call records that every row it shows up to the call's
    /// last row is in the shard.
    async fn publish(
        &mut self,
        shard: u32,
        entries: Vec<StreamEntry>,
        mut meta: PartMeta,
        progress: Option<&Snapshot>,
    ) -> Result<(), RelayError> {
        // Never more at once than a quarter of the cap, so each call fits beside what the
        // groups have not read yet, under the three quarters a catch-up may fill.
        let cap = self.publisher.max_len();
        let mut per_call = self.ctx.config.batch.max_entries.max(1);
        if cap > 0 {
            per_call = per_call.min((cap / 4).max(1) as usize);
        }
        let mut chunks: Vec<&[StreamEntry]> = entries.chunks(per_call).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        for chunk in chunks {
            if !chunk.is_empty() {
                self.wait_for_room(shard, chunk.len() as u64).await?;
            }
            // The entry before the chunk's first (or the shard's top): the stream must hold it.
            meta.fence = match chunk.first() {
                Some(first) => Some(EntryId {
                    commit_lsn: first.id.commit_lsn,
                    seq: first.id.seq - 1,
                }),
                None => Some(self.shards[&shard].top),
            }
            .filter(|f| *f != EntryId::default());
            meta.cursor = match (progress, chunk.last().and_then(|last| last.order)) {
                (Some(snapshot), Some(order)) => Some(format!("{snapshot}/{order}")),
                _ => None,
            };
            let refs: Vec<&StreamEntry> = chunk.iter().collect();
            tokio::time::timeout(
                STEP_TIMEOUT,
                self.publisher
                    .publish_part(shard as usize, &refs, &meta, self.origin),
            )
            .await
            .map_err(|_| timed_out("publishing"))??;
            self.ctx
                .metrics
                .republished_events_total
                .inc_by(chunk.len() as u64);
        }
        Ok(())
    }

    /// Wait until `shard` has room for `n` more entries under three quarters of
    /// `--stream-max-len` (the live entries after the hand-over need the rest).
    async fn wait_for_room(&mut self, shard: u32, n: u64) -> Result<(), RelayError> {
        let cap = self.publisher.max_len();
        if cap == 0 {
            return Ok(());
        }
        let fill_to = cap - cap / 4;
        let mut said = None::<Instant>;
        let started = Instant::now();
        loop {
            let (entries, groups) = tokio::time::timeout(STEP_TIMEOUT, self.publisher.room(shard))
                .await
                .map_err(|_| timed_out("reading the room left"))??;
            if entries + n <= fill_to {
                self.ctx.metrics.catch_up_waiting_for_consumers.set(0);
                return Ok(());
            }
            self.ctx.metrics.catch_up_waiting_for_consumers.set(1);
            if let Some(prepared) = self.shards.get_mut(&shard) {
                prepared.check_age(self.ctx);
            }
            if self
                .gives_way
                .is_some_and(|limit| started.elapsed() >= limit)
            {
                // Its progress is in its record: it goes on from there on its next turn.
                self.full = Some(shard);
                return Err(RelayError::StreamFull {
                    stream: self.publisher.shard_stream(shard).to_string(),
                    detail: format!("{entries} entries its consumer groups have not read; the catch-up gives way to the other shards behind"),
                });
            }
            if said.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
                let why = if groups == 0 {
                    "no consumer group reads it yet".to_string()
                } else {
                    format!("{groups} consumer group(s) have not read {entries} of its entries")
                };
                info!(shard, stream = %self.publisher.shard_stream(shard), entries, fill_to, %why, "the catch-up waits for the consumers: nothing unread is ever trimmed");
                said = Some(Instant::now());
            }
            tokio::time::sleep(ROOM_POLL).await;
        }
    }

    /// The hand-over's last snapshot: one that shows every transaction of `dropped` (xids the
    /// slot sent and lanes dropped). Such a transaction is in the WAL before snapshots show it
    /// (its commit may wait for a synchronous standby); taken too early, the snapshot would
    /// leave it to the capture, which began after it was dropped. Waits up to
    /// [`COMMITS_WAIT`], then the catch-up tries again later.
    async fn last_snapshot(
        &self,
        sql: &Client,
        dropped: &[u32],
    ) -> Result<Arc<Watermark>, RelayError> {
        let started = Instant::now();
        let gauge = &self.ctx.metrics.catch_up_waiting_for_commits;
        // Back to 0 however this ends (an answer, an error, the task aborted with its session).
        let _lowered = LowerOnDrop(gauge);
        loop {
            let last = take_watermark(sql).await?;
            let snapshot = &last.snapshot;
            let invisible: Vec<u32> = dropped
                .iter()
                .copied()
                .filter(|x| !snapshot.visible(snapshot.widen(*x)))
                .collect();
            if invisible.is_empty() {
                return Ok(Arc::new(last));
            }
            if started.elapsed() >= COMMITS_WAIT {
                return Err(RelayError::CommitsInvisible {
                    count: invisible.len(),
                    waited: COMMITS_WAIT,
                });
            }
            if gauge.get() == 0 {
                info!(transactions = invisible.len(), "the hand-over waits for transactions the slot sent to become visible (commits waiting for a synchronous standby)");
            }
            gauge.set(1);
            tokio::time::sleep(ROOM_POLL).await;
        }
    }

    /// Step 4: capture, the last snapshot and its round, the record's new watermark, rejoin.
    async fn hand_over(
        &mut self,
        sql: &Client,
        table: Option<&Table>,
        prev: Arc<Watermark>,
    ) -> Result<(), RelayError> {
        let shards: Vec<u32> = self.shards.keys().copied().collect();
        let (started, started_rx) = oneshot::channel();
        self.handover
            .send(Handover::Capture {
                shards: shards.clone(),
                started,
            })
            .await
            .map_err(|_| RelayError::ShuttingDown)?;
        // The loop begins at its next transaction boundary: after the one it is receiving,
        // however large; bounded all the same, and a hand-over that cannot begin gives way.
        let dropped = tokio::time::timeout(STEP_TIMEOUT, started_rx)
            .await
            .map_err(|_| timed_out("beginning the capture"))?
            .map_err(|_| RelayError::ShuttingDown)?;
        // Taken after the loop captures, and once it shows every transaction the loop dropped
        // before: a transaction it does not show was then captured.
        let last = self.last_snapshot(sql, &dropped).await?;
        // Recorded below with no acknowledgement: flushed first, so that it holds across a
        // crash like every other recorded watermark (see `source::wait_durable`).
        if !wait_durable(sql, &last, STEP_TIMEOUT).await? {
            return Err(timed_out("the WAL flush through the last snapshot"));
        }
        if let Some(table) = table {
            self.round(sql, table, Some(&prev.snapshot), &last, None)
                .await?;
        }
        self.watermarks.push((*last).clone());
        for k in shards {
            // Its record gets the last snapshot as its watermark (every row it shows is in
            // the shard now) and loses its marker.
            let meta = PartMeta {
                watermark: Some(last.clone()),
                rejoin: true,
                ..PartMeta::default()
            };
            self.publish(k, Vec::new(), meta, None).await?;
            let top = self.shards[&k].top;
            let (done, done_rx) = oneshot::channel();
            self.handover
                .send(Handover::Rejoin {
                    shard: k,
                    top: (top != EntryId::default()).then_some(top),
                    watermark: last.clone(),
                    done,
                })
                .await
                .map_err(|_| RelayError::ShuttingDown)?;
            if done_rx.await.unwrap_or(false) {
                self.rejoined.push(k);
            }
        }
        info!(shards = ?self.rejoined, republished = self.published, "caught up from the outbox table");
        Ok(())
    }
}

/// Sets its gauge to 0 when dropped.
struct LowerOnDrop<'g>(&'g prometheus::IntGauge);

impl Drop for LowerOnDrop<'_> {
    fn drop(&mut self) {
        self.0.set(0);
    }
}

fn timed_out(what: &str) -> RelayError {
    RelayError::Redis(redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("catch-up: {what} took longer than {STEP_TIMEOUT:?}"),
    )))
}

/// The outbox table's queries, by the mapping's columns (plain lowercase names, so quoting
/// them needs no escaping). Rows come back as: 0 order (bigint), 1 id, 2 type, 3 payload,
/// 4 timestamp, 5 key, 6 tx (text or NULL), then the extra columns.
struct Table {
    name: String,
    mapping: Arc<OutboxMapping>,
    /// The key column, or NULL for a table without it.
    key: String,
    /// The payload is bytea: published as its bytes.
    payload_bytea: bool,
}

impl Table {
    async fn of(sql: &Client, ctx: &SharedContext) -> Result<Self, RelayError> {
        let mapping = Arc::clone(&ctx.config.postgres.outbox);
        let table = &mapping.table;
        let types: Vec<(String, u32)> = sql
            .query(
                "SELECT a.attname::text, a.atttypid::oid FROM pg_attribute a
                  WHERE a.attrelid = to_regclass(format('%I.%I', $1::text, $2::text))
                    AND a.attnum > 0 AND NOT a.attisdropped",
                &[&table.schema, &table.table],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let type_of = |column: &str| types.iter().find(|(n, _)| n == column).map(|(_, t)| *t);
        Ok(Self {
            name: format!("\"{}\".\"{}\"", table.schema, table.table),
            key: match type_of(mapping.key.as_str()) {
                Some(_) => mapping.key.as_sent("o"),
                None => "NULL::text".into(),
            },
            payload_bytea: type_of(mapping.payload.as_str()) == Some(BYTEA_OID),
            mapping,
        })
    }

    /// The least order value of the rows of transactions from `$1` on that `$2` shows.
    fn min_id(&self) -> String {
        let m = &self.mapping;
        format!(
            "SELECT min(o.{order})::bigint FROM {table} o
              WHERE o.{tx} >= $1::text::xid8 AND pg_visible_in_snapshot(o.{tx}, $2::text::pg_snapshot)",
            order = m.order.quoted(),
            tx = m.tx.quoted(),
            table = self.name,
        )
    }

    /// A page of candidates in order after `$1`: shown by `$3`, not by `$4` (when given),
    /// of transactions from `$2` on (when bounded), and not already in the stream; of the
    /// first `$5` such rows, as many as fit in `$6` bytes (at least one), so a page of large
    /// rows is bounded in memory like a batch.
    fn select(&self, bounded: bool) -> String {
        let m = &self.mapping;
        let tx = m.tx.quoted();
        let bound = if bounded {
            format!("AND o.{tx} >= $2::text::xid8")
        } else {
            "AND ($2::text IS NULL OR true)".to_string()
        };
        let timestamp = match &m.timestamp {
            Some(t) => t.as_sent("o"),
            None => "NULL::text".into(),
        };
        // In the stream already: the same id (and, with a timestamp column, the same
        // timestamp: an id used again after the table was emptied is another row).
        let present = match &m.timestamp {
            Some(t) => format!(
                "p.id = {id} AND p.created_at = o.{t}",
                id = m.id.as_sent("o"),
                t = t.quoted()
            ),
            None => format!("p.id = {id}", id = m.id.as_sent("o")),
        };
        let extra: String = m
            .extra
            .iter()
            .enumerate()
            .map(|(i, e)| format!(", {} AS x{i}", e.column.as_sent("o")))
            .collect();
        let extra_out: String = (0..m.extra.len()).map(|i| format!(", x{i}")).collect();
        // Last, after the extra fields (see `event`).
        let route = match &m.route {
            Some(r) => r.as_sent("o"),
            None => "NULL::text".into(),
        };
        format!(
            "SELECT ord, id, event, payload, created_at, key, tx{extra_out}, route FROM (
             SELECT *, sum(size) OVER (ORDER BY ord) - size AS before FROM (
               SELECT o.{order}::bigint AS ord, {id_sent} AS id, {event_sent} AS event,
                      {payload_sent} AS payload, {timestamp} AS created_at,
                      {key} AS key, o.{tx}::text AS tx{extra}, {route} AS route,
                      octet_length(o.{event}::text) + coalesce(octet_length(o.{payload}::text), 0) AS size
                 FROM {table} o
                WHERE o.{order} > $1
                  {bound}
                  AND (o.{tx} IS NULL OR pg_visible_in_snapshot(o.{tx}, $3::text::pg_snapshot))
                  AND ($4::text IS NULL
                       OR (o.{tx} IS NOT NULL AND NOT pg_visible_in_snapshot(o.{tx}, $4::text::pg_snapshot)))
                  AND NOT EXISTS (SELECT 1 FROM pg_temp.cdc_relay_present p WHERE {present})
                ORDER BY o.{order}
                LIMIT $5
             ) page ) sized
             WHERE before < $6
             ORDER BY ord",
            order = m.order.quoted(),
            event = m.event_type.quoted(),
            payload = m.payload.quoted(),
            id_sent = m.id.as_sent("o"),
            event_sent = m.event_type.as_sent("o"),
            payload_sent = m.payload.as_sent("o"),
            key = self.key,
            table = self.name,
        )
    }

    /// One row of [`select`](Self::select) as the event it publishes.
    fn event(&self, row: &tokio_postgres::Row) -> OutboxEvent {
        let text = |i: usize| row.get::<_, Option<String>>(i).map(bytes::Bytes::from);
        OutboxEvent {
            outbox_id: text(1).unwrap_or_default(),
            event: text(2).unwrap_or_default(),
            payload: text(3)
                .map(|p| stored_payload(p, self.payload_bytea))
                .unwrap_or_default(),
            created_at: text(4).map(rfc3339_utc),
            key: text(5),
            // Republished long after their request: their traces ended then.
            traceparent: None,
            extra: self
                .mapping
                .extra
                .iter()
                .enumerate()
                .filter_map(|(i, e)| Some((bytes::Bytes::from(e.field.clone()), text(7 + i)?)))
                .collect(),
            route: text(7 + self.mapping.extra.len()),
        }
    }
}
