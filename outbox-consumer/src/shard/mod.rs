//! One shard's consumer: the shard's stream in, each entry handed to the application's
//! [`Inbox`] to record under the shard's fence, then acknowledged. The Redis consumer-group
//! protocol it speaks is in [`group`]; recording ahead of the reads through a backlog in
//! [`ahead`].
//!
//! Invariants:
//! - `XACK` only after the application's transaction committed and [`Inbox::committed`]
//!   ran; a crash anywhere before it means redelivery, and the application's inbox (each
//!   entry recorded once) absorbs the duplicate, which is handed to `committed` again (its
//!   first showing may never have happened).
//! - One active consumer per shard of the stream (a lease, fenced by the shard's epoch where
//!   the application's writes land), reading in stream order, so each order key's entries (a
//!   key lives in one shard) are recorded in the sender's commit order. On taking the lease
//!   it first claims every pending entry of the shard's group and processes its own pending
//!   list in id order. Instances share the shards fairly (see `members`); with one shard
//!   every instance simply competes for the one lease.
//! - An entry that cannot be decoded, that the database refuses for its own data, or whose
//!   processing ended with the consumer process more than `max_deliveries` times goes to the
//!   dead-letter stream with the reason, atomically with its `XACK`; it never blocks the
//!   entries after it. The database's state is nobody's entry's fault: the batch is retried
//!   in place, and session restarts and handovers never count.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use outbox_core::backoff::{jitter, Backoff};
use outbox_core::connect::RedisConn;
use outbox_core::lease::Lease;
use outbox_core::stream::keys::origin_key;
use outbox_core::stream::record::{check_layout, recorded_shards};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::config::{ConsumerConfig, ShardKeys};
use crate::inbox::{Entry, Fence, Inbox, RecordError};
use crate::members::Assignment;
use crate::metrics::ConsumerMetrics;
use crate::status::{ConsumerRole, ShardRoles};

mod ahead;
pub(crate) mod group;

/// Entries read per call.
const READ_COUNT: usize = 100;
/// How long one blocking read waits for new entries: also how long a handover or a
/// shutdown waits for the read in flight to come back (it is never abandoned).
const READ_BLOCK: Duration = Duration::from_secs(1);
/// How often a standby that wants a shard tries its lease: a handover is taken over this
/// soon after the previous holder released it.
const WANTED_LEASE_POLL: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
enum ConsumeError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("lost the consumer lease")]
    LeaseLost,
    #[error("{0}")]
    Inbox(RecordError),
    #[error("unexpected reply: {0}")]
    Reply(String),
    #[error("{0}")]
    Layout(String),
}

/// Whether a step ends because of shutdown.
enum Flow {
    Continue,
    Shutdown,
    /// Another live instance wants this shard: give its lease up.
    Handover,
}

/// One shard's consumer: tries the shard's lease while this instance wants the shard,
/// and consumes while it holds it.
pub(crate) struct ShardConsumer<I: Inbox> {
    config: Arc<ConsumerConfig>,
    keys: ShardKeys,
    inbox: Arc<I>,
    metrics: Arc<ConsumerMetrics>,
    roles: Arc<ShardRoles>,
    /// The shards this instance should try to hold.
    assignment: watch::Receiver<Assignment>,
    /// This process's run, in attempt records: a record of another run means that run ended
    /// (crashed) while processing the entry.
    run_id: String,
    /// Entries this run was handed (new ones as they are read, others once processing
    /// starts) and has not finished, with their attempt numbers: whatever this run
    /// re-reads from this map is its own, never a sign of a crash.
    delivered: Mutex<HashMap<String, u64>>,
    /// Redis refused the look-ahead's commands (an ACL from before it, not reloaded): the
    /// shard is consumed in order only, said once.
    ahead_refused: AtomicBool,
}

impl<I: Inbox> ShardConsumer<I> {
    pub(crate) fn new(
        config: Arc<ConsumerConfig>,
        shard: u32,
        inbox: Arc<I>,
        metrics: Arc<ConsumerMetrics>,
        roles: Arc<ShardRoles>,
        assignment: watch::Receiver<Assignment>,
    ) -> Self {
        Self {
            keys: config.shard(shard),
            config,
            inbox,
            metrics,
            roles,
            assignment,
            run_id: uuid::Uuid::new_v4().simple().to_string(),
            delivered: Mutex::new(HashMap::new()),
            ahead_refused: AtomicBool::new(false),
        }
    }

    fn shard(&self) -> u32 {
        self.keys.shard
    }

    fn set_role(&self, role: ConsumerRole) {
        self.roles.set(self.shard(), role);
    }

    fn role(&self) -> ConsumerRole {
        self.roles.get(self.shard())
    }

    /// Whether this instance should try to hold this shard.
    fn wanted(&self) -> bool {
        self.assignment
            .borrow()
            .get(self.shard() as usize)
            .copied()
            .unwrap_or(false)
    }

    fn set_redis(&self, ok: bool, error: Option<String>) {
        self.roles.status().send_if_modified(|s| {
            let changed = s.redis_reachable != ok || (error.is_some() && s.last_error != error);
            s.redis_reachable = ok;
            if error.is_some() {
                s.last_error = error.clone();
            }
            changed
        });
    }

    /// Consume until `shutdown`.
    pub(crate) async fn run(&self, shutdown: CancellationToken) {
        let lease = Lease::new(
            self.keys.lease.clone(),
            &self.config.consumer,
            self.config.lease_ttl,
        );
        let mut backoff = Backoff::reconnecting(Duration::from_millis(100));
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            match self.session(&lease, &shutdown).await {
                Ok(Flow::Handover) => {
                    info!(shard = self.shard(), consumer = %self.config.consumer, "gave the shard up to the instance that wants it now");
                    self.set_role(ConsumerRole::Standby);
                }
                Ok(_) => break,
                Err(e) => {
                    let delay = backoff.next_delay();
                    if matches!(e, ConsumeError::Redis(_)) {
                        self.set_redis(false, Some(e.to_string()));
                    }
                    if let ConsumeError::Layout(message) = &e {
                        error!(shard = self.shard(), "{message}");
                        self.roles.set_layout_refused(true);
                        self.roles
                            .status()
                            .send_modify(|s| s.last_error = Some(message.clone()));
                    }
                    warn!(error = %e, retry_in = ?delay, "inbox consumer interrupted; retrying");
                    self.set_role(ConsumerRole::Starting);
                    // The database answering again ends the wait: after an outage the shard
                    // resumes within moments of the database, not a backoff later.
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(delay) => {}
                        _ = self.inbox.answering_again() => {}
                    }
                }
            }
        }
        self.set_role(ConsumerRole::Stopped);
    }

    /// Connect, wait for the lease, then consume while holding it.
    async fn session(
        &self,
        lease: &Lease,
        shutdown: &CancellationToken,
    ) -> Result<Flow, ConsumeError> {
        let mut conn = self.config.redis.connect(Duration::from_secs(5)).await?;
        // Its own connection: a blocking read holds up whatever follows it on one.
        let blocking = self
            .config
            .redis
            .connect(READ_BLOCK + Duration::from_secs(5))
            .await?;
        self.set_redis(true, None);
        self.check_layout(&mut conn).await?;
        self.roles.set_layout_refused(false);
        // Standby until the lease is ours (tried only while this instance wants the shard).
        let mut assignment = self.assignment.clone();
        loop {
            if self.wanted() && lease.acquire(&mut conn).await? {
                break;
            }
            if self.role() != ConsumerRole::Standby {
                info!(shard = self.shard(), consumer = %self.config.consumer, "another instance consumes this shard; standing by");
            }
            self.set_role(ConsumerRole::Standby);
            // A shard this instance wants is tried often (its holder is about to hand it
            // over); one it does not want only now and then.
            let poll = if self.wanted() {
                WANTED_LEASE_POLL
            } else {
                lease.ttl() / 5
            };
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(Flow::Shutdown),
                _ = tokio::time::sleep(jitter(poll)) => {}
                changed = assignment.changed() => {
                    if changed.is_err() {
                        // The membership task ended: only shutdown does that.
                        shutdown.cancelled().await;
                        return Ok(Flow::Shutdown);
                    }
                }
            }
        }
        // Fence the previous holder where the writes land (it may be paused, not dead).
        let epoch = match self
            .inbox
            .claim_fence(&self.config.consumer, self.shard())
            .await
        {
            Ok(epoch) => epoch,
            Err(e) => {
                if let Err(e) = lease.release(&mut conn).await {
                    debug!(error = %e, "could not release the lease");
                }
                return Err(ConsumeError::Inbox(e));
            }
        };
        if !lease.acquire(&mut conn).await? {
            // The claim outlasted the lease: whoever holds it now bumps the epoch again.
            return Err(ConsumeError::LeaseLost);
        }
        info!(consumer = %self.config.consumer, stream = %self.keys.stream, shard = self.shard(), group = %self.config.group, epoch, "inbox consumer active");
        self.set_role(ConsumerRole::Active);
        // Whatever a previous holder recorded and never showed may be shown now.
        self.inbox.took_shard(self.shard());
        let mut active = Active {
            consumer: self,
            lease,
            conn,
            blocking,
            renew_at: Instant::now() + lease.ttl() / 3,
            fence: Fence {
                shard: self.shard(),
                epoch,
            },
            inherited: Default::default(),
            suspects: Default::default(),
            foreign: Default::default(),
            ahead: Default::default(),
        };
        let result = active.consume(shutdown).await;
        active.release_delivered().await;
        if let Err(e) = lease.release(&mut active.conn).await {
            debug!(error = %e, "could not release the lease");
        }
        result
    }

    /// Refuse to consume a stream whose records say it has another shard count (checked
    /// on every session; the relay writes the records).
    async fn check_layout(&self, conn: &mut RedisConn) -> Result<(), ConsumeError> {
        if !self.config.check_layout {
            return Ok(());
        }
        let key = origin_key(&self.keys.stream);
        let recorded = match recorded_shards(conn, &key).await {
            Ok(count) => count.into_iter().collect(),
            // An ACL from before shards existed (it allows the plain stream only): the
            // check is skipped, not the consuming.
            Err(e) if e.code() == Some("NOPERM") => {
                warn!(%key, "the Redis user may not read the stream's record, so the shard count is not checked; load the current deploy/redis/users.acl");
                Vec::new()
            }
            Err(e) => return Err(e.into()),
        };
        check_layout(conn, &self.config.stream, self.config.shards, recorded)
            .await?
            .map_err(|e| ConsumeError::Layout(e.0))
    }
}

/// What happens to entries once their recording committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    /// The ordered path: acknowledged.
    Acknowledge,
    /// Recorded ahead of the reads (see `ahead`): left in the stream until the ordered
    /// path reaches them.
    KeepPending,
}

/// How recording a batch ended.
enum Recorded {
    /// Every part committed (and was acknowledged or kept, see [`After`]).
    Done,
    /// The database refused a row of a part for its own data; the entries before that part
    /// (the count) committed, and the rest did not.
    Rejected(RecordError, usize),
    Shutdown,
}

/// The consumer while it holds the lease.
struct Active<'a, I: Inbox> {
    consumer: &'a ShardConsumer<I>,
    lease: &'a Lease,
    conn: RedisConn,
    blocking: RedisConn,
    renew_at: Instant,
    /// This holder's fence; writes with an older epoch are refused.
    fence: Fence,
    /// Entries pending under this consumer's name that this run was not handed: a previous
    /// process of the same name (two live ones never share a name) left them, so it ended.
    inherited: HashSet<String>,
    /// Entries another run was processing when it lost the shard (see `Active::attempts`):
    /// processed alone, so that if one of them is what ended that run, it ends no more than
    /// one more.
    suspects: HashSet<String>,
    /// Entries whose attempt records name another run that ended while recording them
    /// ahead of its reads: processed alone when read (see `ahead`).
    foreign: HashSet<String>,
    /// Scanning ahead of the reads through a backlog (see `ahead`).
    ahead: ahead::Ahead,
}

impl<I: Inbox> Active<'_, I> {
    fn config(&self) -> &ConsumerConfig {
        &self.consumer.config
    }

    fn keys(&self) -> &ShardKeys {
        &self.consumer.keys
    }

    fn inbox(&self) -> &I {
        &self.consumer.inbox
    }

    fn metrics(&self) -> &ConsumerMetrics {
        &self.consumer.metrics
    }

    async fn consume(&mut self, shutdown: &CancellationToken) -> Result<Flow, ConsumeError> {
        self.ensure_group().await?;
        self.count_dead_letters().await?;
        self.inherited = self.inherited_entries().await?;
        self.foreign = self.foreign_records().await?;
        // Holding the lease, nobody else consumes: everything pending in the group is ours
        // to finish, in id order, before anything new.
        self.claim(Duration::ZERO).await?;
        if let Flow::Shutdown = self.drain_own_pending(shutdown).await? {
            return Ok(Flow::Shutdown);
        }
        let claim_every = (self.config().claim_idle / 2).max(Duration::from_millis(100));
        let mut next_claim = Instant::now() + claim_every;
        loop {
            // Stop reading first: nothing is read after SIGTERM, and what was read is
            // recorded (below) before the lease goes.
            if shutdown.is_cancelled() {
                return Ok(Flow::Shutdown);
            }
            self.renew_if_due().await?;
            if Instant::now() >= next_claim {
                self.count_dead_letters().await?;
                if self.claim(self.config().claim_idle).await? > 0 {
                    if let Flow::Shutdown = self.drain_own_pending(shutdown).await? {
                        return Ok(Flow::Shutdown);
                    }
                }
                next_claim = Instant::now() + claim_every;
            }
            let issued = Instant::now();
            if !self.consumer.wanted() {
                // Another live instance wants this shard now (one joined, or this one's
                // view was stale): finish here and let it take over.
                return Ok(Flow::Handover);
            }
            // Not raced against shutdown: a blocking read abandoned here stays blocked in
            // Redis, which would hand the next entry to this departed consumer (where it
            // waits for a claim and is charged a delivery). It returns within READ_BLOCK,
            // and its entries are recorded before the consumer stops.
            let entries = self.read(">").await?;
            // A read that outlasted its block was paused (a stall, SIGSTOP): another
            // instance may hold the lease now. Check before claiming or re-reading
            // anything, which would raise the new holder's delivery counts.
            if issued.elapsed() > READ_BLOCK + Duration::from_millis(500)
                && !self.lease.acquire(&mut self.conn).await?
            {
                return Err(ConsumeError::LeaseLost);
            }
            if !entries.is_empty() && self.took_older_entries(&entries).await? {
                // A previous holder, paused while its blocking read was outstanding, was
                // handed entries older than these: they are ours now; record all in order.
                if let Flow::Shutdown = self.drain_own_pending(shutdown).await? {
                    return Ok(Flow::Shutdown);
                }
                continue;
            }
            // A full read means more is waiting: a backlog, which the look-ahead lets the
            // order keys with little in it pass.
            let full = entries.len() == READ_COUNT;
            let last = match entries.last() {
                Some(entry) => entry.id.parse()?,
                None => ahead::StreamId::default(),
            };
            if !entries.is_empty() {
                if let Flow::Shutdown = self.process(entries, shutdown).await? {
                    return Ok(Flow::Shutdown);
                }
            }
            self.ahead.processed_to(last, full);
            if self.ahead.is_active() && !self.consumer.ahead_refused.load(Ordering::Relaxed) {
                if let Flow::Shutdown = self.look_ahead(shutdown).await? {
                    return Ok(Flow::Shutdown);
                }
            }
        }
    }

    async fn renew_if_due(&mut self) -> Result<(), ConsumeError> {
        if Instant::now() >= self.renew_at {
            if !self.lease.acquire(&mut self.conn).await? {
                return Err(ConsumeError::LeaseLost);
            }
            self.renew_at = Instant::now() + self.lease.ttl() / 3;
        }
        Ok(())
    }

    /// Process this consumer's own pending entries, oldest first.
    async fn drain_own_pending(
        &mut self,
        shutdown: &CancellationToken,
    ) -> Result<Flow, ConsumeError> {
        let mut after = "0".to_string();
        loop {
            let entries = self.read(&after).await?;
            let Some(last) = entries.last() else {
                return Ok(Flow::Continue);
            };
            after = last.id.clone();
            if let Flow::Shutdown = self.process(entries, shutdown).await? {
                return Ok(Flow::Shutdown);
            }
        }
    }

    /// Process a batch read from the group. Once an entry of it has been attempted before
    /// (its processing ended with a process), the batch goes one entry at a time, so an
    /// entry that kills its consumer is dead-lettered alone, not with its batch.
    async fn process(
        &mut self,
        entries: Vec<Entry>,
        shutdown: &CancellationToken,
    ) -> Result<Flow, ConsumeError> {
        // Recorded and shown already: only acknowledged now.
        let (done, entries): (Vec<Entry>, Vec<Entry>) = entries
            .into_iter()
            .partition(|e| self.ahead.take_recorded(&e.id));
        if !done.is_empty() {
            let ids: Vec<String> = done.into_iter().map(|e| e.id).collect();
            self.ack(&ids).await?;
        }
        if entries.is_empty() {
            return Ok(Flow::Continue);
        }
        let Some(attempts) = self.attempts(&entries, shutdown).await? else {
            return Ok(Flow::Shutdown);
        };
        {
            let mut delivered = self.consumer.delivered.lock().unwrap();
            for e in &entries {
                delivered.insert(e.id.clone(), attempts.get(&e.id).copied().unwrap_or(1));
            }
        }
        let isolate = attempts.values().any(|n| *n >= 2)
            || entries.iter().any(|e| self.suspects.contains(&e.id));
        for e in &entries {
            self.suspects.remove(&e.id);
        }
        if entries.len() > 1 && isolate {
            for entry in entries {
                let single = vec![entry];
                self.begin_attempts(&single, &attempts).await?;
                if let Flow::Shutdown = self.process_batch(single, &attempts, shutdown).await? {
                    return Ok(Flow::Shutdown);
                }
            }
            return Ok(Flow::Continue);
        }
        self.begin_attempts(&entries, &attempts).await?;
        self.process_batch(entries, &attempts, shutdown).await
    }

    /// Record what can be recorded of a batch, dead-letter what cannot (each with its
    /// reason), and acknowledge both.
    async fn process_batch(
        &mut self,
        entries: Vec<Entry>,
        attempts: &HashMap<String, u64>,
        shutdown: &CancellationToken,
    ) -> Result<Flow, ConsumeError> {
        let read_at = SystemTime::now();
        let recorded_before = self.recorded_among_doomed(&entries, attempts).await?;
        let Sorted {
            received,
            mut dead,
            gone,
        } = self.sort(entries, attempts, &recorded_before);
        if !gone.is_empty() {
            error!(
                count = gone.len(),
                "pending entries were trimmed from the stream before being recorded"
            );
            self.metrics().entries_lost_total.inc_by(gone.len() as u64);
            self.ack(&gone).await?;
        }
        if !received.is_empty() {
            let recorded = self
                .record_in_parts(&received, read_at, After::Acknowledge, shutdown)
                .await?;
            match recorded {
                Recorded::Done => {}
                Recorded::Shutdown => return Ok(Flow::Shutdown),
                Recorded::Rejected(rejected, committed) => {
                    // The database refused the batch itself: record the rest entry by
                    // entry and dead-letter the ones it refuses.
                    warn!(error = %rejected, "inbox insert refused; recording entries one at a time");
                    for single in received[committed..].chunks(1) {
                        match self
                            .record_in_parts(single, read_at, After::Acknowledge, shutdown)
                            .await?
                        {
                            Recorded::Done => {}
                            Recorded::Shutdown => return Ok(Flow::Shutdown),
                            Recorded::Rejected(e, _) => {
                                dead.push((single[0].0.clone(), e.to_string()))
                            }
                        }
                    }
                }
            }
        }
        for (entry, reason) in dead {
            self.dead_letter(&entry, &reason).await?;
        }
        Ok(Flow::Continue)
    }

    /// A batch's entries by what becomes of them: decoded for recording, dead (with the
    /// reason), or gone (trimmed from the stream).
    fn sort(
        &self,
        entries: Vec<Entry>,
        attempts: &HashMap<String, u64>,
        recorded_before: &HashSet<String>,
    ) -> Sorted<I::Item> {
        let mut sorted = Sorted {
            received: Vec::new(),
            dead: Vec::new(),
            gone: Vec::new(),
        };
        let max_deliveries = self.config().max_deliveries;
        for entry in entries {
            if entry.fields.is_none() {
                sorted.gone.push(entry.id);
                continue;
            }
            let attempt = attempts.get(&entry.id).copied().unwrap_or(1);
            if attempt > max_deliveries && !recorded_before.contains(&entry.id) {
                let reason = format!(
                    "its processing ended with the consumer process while it was processed alone (conclusive), or {max_deliveries} times in all; delivered {} times",
                    entry.deliveries
                );
                sorted.dead.push((entry, reason));
                continue;
            }
            match self.inbox().decode(&entry) {
                Ok(item) => sorted.received.push((entry, item)),
                Err(reason) => sorted.dead.push((entry, reason)),
            }
        }
        sorted
    }

    /// Entries past their last delivery that the application holds already: the run that
    /// ended with them (killed after its commit, before its acknowledgement) recorded them,
    /// so they are shown and acknowledged, not dead-lettered.
    async fn recorded_among_doomed(
        &self,
        entries: &[Entry],
        attempts: &HashMap<String, u64>,
    ) -> Result<HashSet<String>, ConsumeError> {
        let max_deliveries = self.config().max_deliveries;
        let doomed: Vec<(&str, I::Item)> = entries
            .iter()
            .filter(|e| attempts.get(&e.id).copied().unwrap_or(1) > max_deliveries)
            .filter(|e| e.fields.is_some())
            .filter_map(|e| Some((e.id.as_str(), self.inbox().decode(e).ok()?)))
            .collect();
        if doomed.is_empty() {
            return Ok(Default::default());
        }
        let items: Vec<&I::Item> = doomed.iter().map(|(_, item)| item).collect();
        // Unknown is dead-lettered as before: a replay of a dead letter the inbox holds is
        // skipped as a duplicate, so the cost is a false alarm, never a second showing.
        let held = match self.inbox().holds(&items).await {
            Ok(held) => held,
            Err(e) => {
                warn!(error = %e, "could not look up entries past their last delivery in the inbox; dead-lettering them");
                Vec::new()
            }
        };
        Ok(doomed
            .iter()
            .zip(held)
            .filter(|(_, held)| *held)
            .map(|((id, _), _)| id.to_string())
            .collect())
    }

    /// Record `batch` in order, each part in one transaction, then acknowledge it or keep
    /// it pending (`after`). While the database is too busy for a part (a statement or lock
    /// wait running out on the server) it is halved: each try then holds fewer rows' locks,
    /// so other writers go on, and a slow database is not asked the same too-large write
    /// forever. One entry is always written whole.
    async fn record_in_parts(
        &mut self,
        batch: &[(Entry, I::Item)],
        read_at: SystemTime,
        after: After,
        shutdown: &CancellationToken,
    ) -> Result<Recorded, ConsumeError> {
        let mut parts: Vec<&[(Entry, I::Item)]> = vec![batch];
        let mut halving = false;
        // Parts are written in stream order: what committed is a prefix of the batch.
        let mut committed = 0;
        while let Some(part) = parts.pop() {
            if halving {
                // Each try took up to a statement deadline: keep the lease, and stop for
                // SIGTERM or a shard another instance wants (what is not recorded stays
                // pending for the next holder).
                if shutdown.is_cancelled() {
                    return Ok(Recorded::Shutdown);
                }
                if !self.consumer.wanted() {
                    return Err(ConsumeError::LeaseLost);
                }
                self.renew_if_due().await?;
            }
            match self.record(part, shutdown).await? {
                Written::Done(recorded) => {
                    self.after_commit(part, recorded, read_at, after).await?;
                    committed += part.len();
                }
                Written::TooLarge => {
                    halving = true;
                    let (first, rest) = part.split_at(part.len() / 2);
                    warn!(
                        entries = part.len(),
                        "the database is too busy for this inbox write; writing it in halves"
                    );
                    self.metrics()
                        .write_retries_total
                        .with_label_values(&["busy"])
                        .inc();
                    parts.push(rest);
                    parts.push(first);
                }
                Written::Rejected(e) => return Ok(Recorded::Rejected(e, committed)),
                Written::Shutdown => return Ok(Recorded::Shutdown),
            }
        }
        Ok(Recorded::Done)
    }

    /// Hand `part` to the application, retrying in place (keeping the lease, never counting
    /// a delivery) while the database is unavailable or its state refuses the write: that
    /// is nobody's entry's fault. Only a row refused for its own data comes back as
    /// `Rejected`; a busy database refusing a part of more than one entry as `TooLarge`.
    async fn record(
        &mut self,
        part: &[(Entry, I::Item)],
        shutdown: &CancellationToken,
    ) -> Result<Written<I::Recorded>, ConsumeError> {
        let mut backoff = Backoff::reconnecting(Duration::from_millis(100));
        loop {
            let e = match self.inbox().record(part, self.fence).await {
                Ok(recorded) => return Ok(Written::Done(recorded)),
                Err(e) => e,
            };
            let cause = match &e {
                // Another instance is the writer now: leave the batch to it.
                RecordError::Fenced { ours, current } => {
                    warn!(
                        ours,
                        current, "another instance became the inbox writer; standing down"
                    );
                    return Err(ConsumeError::LeaseLost);
                }
                RecordError::Refused(_) => return Ok(Written::Rejected(e)),
                RecordError::Busy(_) if part.len() > 1 => return Ok(Written::TooLarge),
                RecordError::Busy(_) | RecordError::Unavailable(_) => "unavailable",
                RecordError::State(_) => "database_state",
            };
            let delay = backoff.next_delay();
            self.metrics()
                .write_retries_total
                .with_label_values(&[cause])
                .inc();
            warn!(error = %e, cause, retry_in = ?delay, entries = part.len(), "inbox write failed for a reason that is not the entries' fault; retrying the same entries");
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(Written::Shutdown),
                _ = tokio::time::sleep(delay) => {}
                _ = self.consumer.inbox.answering_again() => {}
            }
            if !self.consumer.wanted() {
                // This instance left the member set (it cannot reach the database, say):
                // the shard goes to one that can; the batch stays pending for it.
                return Err(ConsumeError::LeaseLost);
            }
            self.renew_if_due().await?;
        }
    }

    /// After a part's commit: the application shows it, then it is acknowledged (or kept
    /// pending, recorded ahead).
    async fn after_commit(
        &mut self,
        part: &[(Entry, I::Item)],
        recorded: I::Recorded,
        read_at: SystemTime,
        after: After,
    ) -> Result<(), ConsumeError> {
        self.inbox()
            .committed(part, recorded, read_at)
            .map_err(ConsumeError::Reply)?;
        match after {
            After::Acknowledge => {
                let ids: Vec<String> = part.iter().map(|(e, _)| e.id.clone()).collect();
                self.ack(&ids).await
            }
            After::KeepPending => {
                self.metrics()
                    .recorded_ahead_total
                    .inc_by(part.len() as u64);
                for (entry, _) in part {
                    self.ahead.recorded_ahead(entry.id.parse()?);
                }
                Ok(())
            }
        }
    }
}

/// A batch's entries by what becomes of them (see [`Active::sort`]).
struct Sorted<T> {
    received: Vec<(Entry, T)>,
    dead: Vec<(Entry, String)>,
    gone: Vec<String>,
}

/// How one write of a part ended.
enum Written<R> {
    Done(R),
    Rejected(RecordError),
    Shutdown,
    /// The database is too busy for a part this large: write it in smaller parts.
    TooLarge,
}
