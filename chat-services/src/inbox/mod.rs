//! The inbox consumer's loop: the other side's stream in, each message recorded once in
//! this side's inbox (taking its place in the chat's feed), shown on every instance, then
//! acknowledged. The Redis consumer-group protocol it speaks is in [`group`].
//!
//! Invariants:
//! - `XACK` only after the inbox transaction committed; a crash anywhere before it means
//!   redelivery, and the inbox (unique message id) absorbs the duplicate, which is shown
//!   again (its first showing may never have happened).
//! - Shown only after the commit; streams read the feed from the database, so a crash
//!   between commit and hint hides nothing (see `notify` for the safety nets).
//! - One active consumer per shard of the stream (a lease, fenced by the shard's epoch where
//!   the inbox writes land), reading in stream order, so each chat's messages (a chat lives
//!   in one shard) are recorded in the sender's commit order. On taking the lease it first
//!   claims every pending entry of the shard's group and processes its own pending list in
//!   id order. Instances share the shards fairly (see [`shards`]); with one shard every
//!   instance simply competes for the one lease.
//! - An entry that cannot be parsed, that Postgres refuses for its own data, or whose
//!   processing ended with the consumer process more than `max_deliveries` times goes to the
//!   dead-letter stream with the reason, atomically with its `XACK`; it never blocks the
//!   entries after it. The database's state is nobody's entry's fault: the batch is retried
//!   in place, and session restarts and handovers never count.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::backoff::jitter;
use outbox_core::connect::{RedisConn, RedisTarget};
use outbox_core::lease::Lease;
use outbox_core::stream::entry;
use outbox_core::stream::keys::{self, origin_key};
use outbox_core::stream::record::{check_layout, recorded_shards};
use outbox_core::stream::shard_key;
use outbox_core::telemetry;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::hub::Delivery;
use crate::metrics::Metrics;
use crate::model::{self, HistoryItem};
use crate::notify::Announcer;
use crate::side::Side;
use crate::store::{Position, Received, Store, StoreError};
use group::Entry;

mod ahead;
mod group;
pub(crate) mod shards;

pub(crate) use shards::{Assignment, ShardRoles};

/// Entries read per call.
const READ_COUNT: usize = 100;
/// How long one blocking read waits for new entries: also how long a handover or a
/// shutdown waits for the read in flight to come back (it is never abandoned).
const READ_BLOCK: Duration = Duration::from_secs(1);
/// How often a standby that wants a shard tries its lease: a handover is taken over this
/// soon after the previous holder released it.
const WANTED_LEASE_POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Clone)]
pub(crate) struct InboxConfig {
    /// The receiving side (this service).
    pub side: Side,
    /// The stream read: this shard of the other side's outbox stream.
    pub stream: String,
    /// This consumer's shard, of `shards`.
    pub shard: u32,
    pub shards: u32,
    /// The shard's lease key (one active consumer per shard).
    pub lease_key: String,
    /// The shard's attempt records (see `group`).
    pub attempts_key: String,
    /// Consumer group: the receiving service's name.
    pub group: String,
    /// This instance's stable consumer name.
    pub consumer: String,
    pub dead_letter_stream: String,
    /// Also counted in the dead-letter gauge: the side's one dead-letter stream from before
    /// the stream was sharded (shard 0's consumer counts it).
    pub legacy_dead_letter_stream: Option<String>,
    /// Dead letters kept at most (the oldest are trimmed beyond it).
    pub dead_letter_max_len: u64,
    /// Pending entries idle this long are claimed (from a consumer that died).
    pub claim_idle: Duration,
    /// Deliveries without acknowledgement after which an entry is dead-lettered.
    pub max_deliveries: u64,
    pub lease_ttl: Duration,
    /// Test hook: SIGKILL this process right after the n-th recorded message was committed
    /// to the inbox and before it is acknowledged.
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    pub crash_after_inbox_commit: Option<u64>,
    /// Test hook: SIGKILL this process when about to record a message with this body.
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    pub crash_on_body: Option<String>,
}

impl InboxConfig {
    /// The consumer of `shard`, from the service's configuration: every key of the shard
    /// derives from the side's base names (`outbox_core::stream::keys`).
    pub(crate) fn for_shard(cfg: &crate::ServiceConfig, shard: u32) -> Self {
        let shards = cfg.stream_shards;
        let key = |base: &str| shard_key(base, shard, shards);
        let group = cfg.side.as_str();
        Self {
            side: cfg.side,
            stream: key(&cfg.inbound_stream),
            shard,
            shards,
            lease_key: key(&keys::inbox_lease_base(group)),
            attempts_key: key(&keys::inbox_attempts_base(group)),
            group: group.to_string(),
            consumer: cfg.consumer_name.clone(),
            dead_letter_stream: key(&cfg.dead_letter_stream),
            legacy_dead_letter_stream: (shards > 1 && shard == 0 && !cfg.redis.is_cluster())
                .then(|| cfg.dead_letter_stream.clone()),
            dead_letter_max_len: cfg.dead_letter_max_len,
            claim_idle: cfg.claim_idle,
            max_deliveries: cfg.max_deliveries,
            lease_ttl: cfg.lease_ttl,
            crash_after_inbox_commit: cfg.crash_after_inbox_commit,
            crash_on_body: cfg.crash_on_body.clone(),
        }
    }
}

/// What the consumer is doing, for /readyz and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConsumerRole {
    Starting,
    /// Another instance holds the lease.
    Standby,
    Active,
    Stopped,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ConsumerStatus {
    /// Active while this instance holds any shard's lease.
    pub role: ConsumerRole,
    /// The shards whose lease this instance holds.
    pub shards: Vec<u32>,
    pub redis_reachable: bool,
    pub last_error: Option<String>,
}

impl Default for ConsumerStatus {
    fn default() -> Self {
        Self {
            role: ConsumerRole::Starting,
            shards: Vec::new(),
            redis_reachable: false,
            last_error: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum ConsumeError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("lost the consumer lease")]
    LeaseLost,
    #[error("{0}")]
    Store(crate::store::StoreError),
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

pub(crate) struct Inbox {
    cfg: InboxConfig,
    client: RedisTarget,
    store: Store,
    announcer: Announcer,
    metrics: Arc<Metrics>,
    roles: Arc<ShardRoles>,
    /// The shards this instance should try to hold.
    assignment: watch::Receiver<Assignment>,
    /// This process's run, in attempt records: a record of another run means that run ended
    /// (crashed) while processing the entry.
    run_id: String,
    /// Entries this run was handed (new ones as they are read, others once processing
    /// starts) and has not finished, with their attempt numbers: whatever this run
    /// re-reads from this map is its own, never a sign of a crash.
    delivered: std::sync::Mutex<HashMap<String, u64>>,
    /// Messages recorded so far (for the `failpoints` crash hook).
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    recorded: AtomicU64,
    /// Redis refused the look-ahead's commands (an ACL from before it, not reloaded): the
    /// shard is consumed in order only, said once.
    ahead_refused: std::sync::atomic::AtomicBool,
}

impl Inbox {
    pub(crate) fn new(
        cfg: InboxConfig,
        client: RedisTarget,
        store: Store,
        announcer: Announcer,
        metrics: Arc<Metrics>,
        roles: Arc<ShardRoles>,
        assignment: watch::Receiver<Assignment>,
    ) -> Self {
        Self {
            cfg,
            client,
            store,
            announcer,
            metrics,
            roles,
            assignment,
            run_id: uuid::Uuid::new_v4().simple().to_string(),
            delivered: std::sync::Mutex::new(HashMap::new()),
            recorded: AtomicU64::new(0),
            ahead_refused: Default::default(),
        }
    }

    fn set_role(&self, role: ConsumerRole) {
        self.roles.set(self.cfg.shard, role);
    }

    fn role(&self) -> ConsumerRole {
        self.roles.get(self.cfg.shard)
    }

    /// Whether this instance should try to hold this shard.
    fn wanted(&self) -> bool {
        self.assignment
            .borrow()
            .get(self.cfg.shard as usize)
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
            self.cfg.lease_key.clone(),
            &self.cfg.consumer,
            self.cfg.lease_ttl,
        );
        let mut backoff = crate::retry_backoff(Duration::from_millis(100));
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            match self.session(&lease, &shutdown).await {
                Ok(Flow::Handover) => {
                    info!(shard = self.cfg.shard, consumer = %self.cfg.consumer, "gave the shard up to the instance that wants it now");
                    self.set_role(ConsumerRole::Standby);
                }
                Ok(_) => break,
                Err(e) => {
                    let delay = backoff.next_delay();
                    if matches!(e, ConsumeError::Redis(_)) {
                        self.set_redis(false, Some(e.to_string()));
                    }
                    if let ConsumeError::Layout(message) = &e {
                        error!(shard = self.cfg.shard, "{message}");
                        self.roles.set_layout_refused(true);
                        self.roles
                            .status()
                            .send_modify(|s| s.last_error = Some(message.clone()));
                    }
                    warn!(error = %e, retry_in = ?delay, "inbox consumer interrupted; retrying");
                    self.set_role(ConsumerRole::Starting);
                    // Postgres answering again ends the wait: after an outage the shard
                    // resumes within moments of the database, not a backoff later.
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(delay) => {}
                        _ = self.store.answering_again() => {}
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
        let mut conn = self.client.connect(Duration::from_secs(5)).await?;
        // Its own connection: a blocking read holds up whatever follows it on one.
        let blocking = self
            .client
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
                info!(shard = self.cfg.shard, consumer = %self.cfg.consumer, "another instance consumes this shard; standing by");
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
            .store
            .claim_inbox_writer(&self.cfg.consumer, self.cfg.shard)
            .await
        {
            Ok(epoch) => epoch,
            Err(e) => {
                let _ = self.release(lease, &mut conn).await;
                return Err(ConsumeError::Store(e));
            }
        };
        if !lease.acquire(&mut conn).await? {
            // The claim outlasted the lease: whoever holds it now bumps the epoch again.
            return Err(ConsumeError::LeaseLost);
        }
        info!(consumer = %self.cfg.consumer, stream = %self.cfg.stream, shard = self.cfg.shard, group = %self.cfg.group, epoch, "inbox consumer active");
        self.set_role(ConsumerRole::Active);
        // Whatever a previous holder recorded and never announced is shown now.
        self.announcer.resync();
        let mut active = Active {
            inbox: self,
            lease,
            conn,
            blocking,
            renew_at: Instant::now() + lease.ttl() / 3,
            epoch,
            inherited: Default::default(),
            suspects: Default::default(),
            foreign: Default::default(),
            ahead: Default::default(),
        };
        let result = active.consume(shutdown).await;
        active.release_delivered().await;
        if let Err(e) = active.inbox.release(lease, &mut active.conn).await {
            debug!(error = %e, "could not release the lease");
        }
        result
    }

    async fn release(&self, lease: &Lease, conn: &mut RedisConn) -> Result<(), ConsumeError> {
        lease.release(conn).await?;
        Ok(())
    }

    /// Refuse to consume a stream whose records say it has another shard count (checked
    /// on every session; the relay writes the records).
    async fn check_layout(&self, conn: &mut RedisConn) -> Result<(), ConsumeError> {
        let base = self.cfg.side.other().outbox_stream();
        if !self.cfg.stream.starts_with(&base) {
            // A stream named by --inbound-stream: its layout is the operator's.
            return Ok(());
        }
        let key = origin_key(&self.cfg.stream);
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
        check_layout(conn, &base, self.cfg.shards, recorded)
            .await?
            .map_err(|e| ConsumeError::Layout(e.0))
    }
}

/// The consumer while it holds the lease.
struct Active<'a> {
    inbox: &'a Inbox,
    lease: &'a Lease,
    conn: RedisConn,
    blocking: RedisConn,
    renew_at: Instant,
    /// This holder's inbox-writer epoch; writes with an older one are refused.
    epoch: i64,
    /// Entries pending under this consumer's name that this run was not handed: a previous
    /// process of the same name (two live ones never share a name) left them, so it ended.
    inherited: std::collections::HashSet<String>,
    /// Entries another run was processing when it lost the shard (see `Active::attempts`):
    /// processed alone, so that if one of them is what ended that run, it ends no more than
    /// one more.
    suspects: std::collections::HashSet<String>,
    /// Entries whose attempt records name another run that ended while recording them
    /// ahead of its reads: processed alone when read (see `ahead`).
    foreign: std::collections::HashSet<String>,
    /// Scanning ahead of the reads through a backlog (see `ahead`).
    ahead: ahead::Ahead,
}

impl Active<'_> {
    fn cfg(&self) -> &InboxConfig {
        &self.inbox.cfg
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
        let claim_every = (self.cfg().claim_idle / 2).max(Duration::from_millis(100));
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
                if self.claim(self.cfg().claim_idle).await? > 0 {
                    if let Flow::Shutdown = self.drain_own_pending(shutdown).await? {
                        return Ok(Flow::Shutdown);
                    }
                }
                next_claim = Instant::now() + claim_every;
            }
            let issued = Instant::now();
            if !self.inbox.wanted() {
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
            // chats with little in it pass.
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
            if self.ahead.is_active() && !self.inbox.ahead_refused.load(Ordering::Relaxed) {
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
    /// (its processing ended with a process), the batch goes one entry at a time, so a
    /// message that kills its consumer is dead-lettered alone, not with its batch.
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
            let mut delivered = self.inbox.delivered.lock().unwrap();
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

    async fn process_batch(
        &mut self,
        entries: Vec<Entry>,
        attempts: &HashMap<String, u64>,
        shutdown: &CancellationToken,
    ) -> Result<Flow, ConsumeError> {
        let read_at = std::time::SystemTime::now();
        let mut received = Vec::new();
        let mut dead = Vec::new();
        let mut gone = Vec::new();
        let recorded_before = self.recorded_among_doomed(&entries, attempts).await?;
        for entry in entries {
            let Some(fields) = &entry.fields else {
                gone.push(entry.id);
                continue;
            };
            let attempt = attempts.get(&entry.id).copied().unwrap_or(1);
            if attempt > self.cfg().max_deliveries && !recorded_before.contains(&entry.id) {
                let reason = format!(
                    "its processing ended with the consumer process while it was processed alone (conclusive), or {} times in all; delivered {} times",
                    self.cfg().max_deliveries,
                    entry.deliveries
                );
                dead.push((entry, reason));
                continue;
            }
            let parsed = model::parse_entry(
                |name| fields.get(name).map(String::as_str),
                self.cfg().side.other(),
            );
            match parsed {
                Ok(message) => received.push((entry, message)),
                Err(e) => dead.push((entry, e.to_string())),
            }
        }
        if !gone.is_empty() {
            error!(
                count = gone.len(),
                "pending entries were trimmed from the stream before being recorded"
            );
            self.inbox
                .metrics
                .entries_lost_total
                .inc_by(gone.len() as u64);
            self.ack(&gone).await?;
        }
        #[cfg(feature = "failpoints")]
        if let Some(body) = &self.cfg().crash_on_body {
            if received.iter().any(|(_, m)| &m.body == body) {
                error!("failpoint: crashing on a received message before recording it");
                // SAFETY: signalling our own process.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
        }
        if !received.is_empty() {
            let batch: Vec<Received> = received
                .iter()
                .map(|(e, m)| Received {
                    stream_id: e.id.clone(),
                    message: m.clone(),
                })
                .collect();
            let recorded = match self.record_in_parts(&batch, shutdown).await? {
                Recorded::Done(positions) => positions,
                Recorded::TooLarge => unreachable!("parts of one entry are written whole"),
                Recorded::Shutdown => return Ok(Flow::Shutdown),
                Recorded::Rejected(rejected) => {
                    // Postgres refused the batch itself: record entries one by one and
                    // dead-letter the ones it refuses.
                    warn!(error = %rejected, "inbox insert refused; recording entries one at a time");
                    let mut positions = HashMap::new();
                    let mut ok = Vec::new();
                    for (entry, message) in received {
                        let single = [Received {
                            stream_id: entry.id.clone(),
                            message: message.clone(),
                        }];
                        match self.record_in_parts(&single, shutdown).await? {
                            Recorded::TooLarge => unreachable!("one entry is written whole"),
                            Recorded::Done(s) => {
                                positions.extend(s);
                                ok.push((entry, message));
                            }
                            Recorded::Shutdown => return Ok(Flow::Shutdown),
                            Recorded::Rejected(e) => {
                                dead.push((entry, format!("postgres refused it: {e}")))
                            }
                        }
                    }
                    received = ok;
                    positions
                }
            };
            self.after_commit(&received, &recorded, read_at).await?;
        }
        for (entry, reason) in dead {
            self.dead_letter(&entry, &reason).await?;
        }
        Ok(Flow::Continue)
    }

    /// Entries past their last delivery whose message the inbox holds already: the run
    /// that ended with them (killed after its commit, before its acknowledgement) recorded
    /// them, so they are shown and acknowledged, not dead-lettered.
    async fn recorded_among_doomed(
        &self,
        entries: &[Entry],
        attempts: &HashMap<String, u64>,
    ) -> Result<std::collections::HashSet<String>, ConsumeError> {
        let doomed: HashMap<uuid::Uuid, &str> = entries
            .iter()
            .filter(|e| attempts.get(&e.id).copied().unwrap_or(1) > self.cfg().max_deliveries)
            .filter_map(|e| {
                let fields = e.fields.as_ref()?;
                let message = model::parse_entry(
                    |name| fields.get(name).map(String::as_str),
                    self.cfg().side.other(),
                )
                .ok()?;
                Some((message.id, e.id.as_str()))
            })
            .collect();
        if doomed.is_empty() {
            return Ok(Default::default());
        }
        let ids: Vec<uuid::Uuid> = doomed.keys().copied().collect();
        // Unknown is dead-lettered as before: a replay of a dead letter the inbox holds is
        // skipped as a duplicate, so the cost is a false alarm, never a second showing.
        let held = match self.inbox.store.inbox_holds(&ids).await {
            Ok(held) => held,
            Err(e) => {
                warn!(error = %e, "could not look up entries past their last delivery in the inbox; dead-lettering them");
                Vec::new()
            }
        };
        Ok(held
            .iter()
            .filter_map(|id| doomed.get(id).map(|s| s.to_string()))
            .collect())
    }

    /// [`Active::record`] `batch`, halving what one transaction writes while the database is
    /// too busy for it (a statement or lock wait running out on the server): each try then
    /// holds fewer chats' feed counters, so the sends to those chats go on, and a slow
    /// database is not asked the same too-large write forever. In order, whole for one entry.
    async fn record_in_parts(
        &mut self,
        batch: &[Received],
        shutdown: &CancellationToken,
    ) -> Result<Recorded, ConsumeError> {
        let mut positions = HashMap::new();
        let mut parts: Vec<&[Received]> = vec![batch];
        let mut halving = false;
        while let Some(part) = parts.pop() {
            if halving {
                // Each try took up to a statement deadline: keep the lease, and stop for
                // SIGTERM or a shard another instance wants (what is not recorded stays
                // pending for the next holder).
                if shutdown.is_cancelled() {
                    return Ok(Recorded::Shutdown);
                }
                if !self.inbox.wanted() {
                    return Err(ConsumeError::LeaseLost);
                }
                self.renew_if_due().await?;
            }
            match self.record(part, shutdown).await? {
                Recorded::Done(p) => positions.extend(p),
                Recorded::TooLarge => {
                    halving = true;
                    let (first, rest) = part.split_at(part.len() / 2);
                    warn!(
                        entries = part.len(),
                        "the database is too busy for this inbox write; writing it in halves"
                    );
                    self.inbox
                        .metrics
                        .inbox_write_retries_total
                        .with_label_values(&["busy"])
                        .inc();
                    parts.push(rest);
                    parts.push(first);
                }
                other => return Ok(other),
            }
        }
        Ok(Recorded::Done(positions))
    }

    /// Insert into the inbox, retrying in place (keeping the lease, never counting a
    /// delivery) while Postgres is unavailable or its state refuses the write (read-only,
    /// permissions, a missing table, a lock): that is nobody's entry's fault. Only a row
    /// Postgres refuses for its own data comes back as `Rejected`; a busy database refusing
    /// a batch of more than one entry comes back as `TooLarge`.
    async fn record(
        &mut self,
        batch: &[Received],
        shutdown: &CancellationToken,
    ) -> Result<Recorded, ConsumeError> {
        let mut backoff = crate::retry_backoff(Duration::from_millis(100));
        loop {
            match self
                .inbox
                .store
                .record_inbox(batch, self.cfg().shard, self.epoch)
                .await
            {
                Ok(positions) => return Ok(Recorded::Done(positions)),
                // Another instance is the writer now: leave the batch to it.
                Err(StoreError::Fenced { ours, current }) => {
                    warn!(
                        ours,
                        current, "another instance became the inbox writer; standing down"
                    );
                    return Err(ConsumeError::LeaseLost);
                }
                Err(e) if e.is_row_refused() => return Ok(Recorded::Rejected(e)),
                Err(StoreError::Busy(_)) if batch.len() > 1 => return Ok(Recorded::TooLarge),
                Err(e) => {
                    let delay = backoff.next_delay();
                    let cause = if e.is_transient() {
                        "unavailable"
                    } else {
                        "database_state"
                    };
                    self.inbox
                        .metrics
                        .inbox_write_retries_total
                        .with_label_values(&[cause])
                        .inc();
                    warn!(error = %e, cause, retry_in = ?delay, entries = batch.len(), "inbox write failed for a reason that is not the entries' fault; retrying the same entries");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(Recorded::Shutdown),
                        _ = tokio::time::sleep(delay) => {}
                        _ = self.inbox.store.answering_again() => {}
                    }
                    if !self.inbox.wanted() {
                        // This instance left the member set (it cannot reach Postgres, say):
                        // the shard goes to one that can; the batch stays pending for it.
                        return Err(ConsumeError::LeaseLost);
                    }
                    self.renew_if_due().await?;
                }
            }
        }
    }

    /// After the inbox commit: show, then acknowledge.
    async fn after_commit(
        &mut self,
        received: &[(Entry, model::Message)],
        recorded: &HashMap<uuid::Uuid, Position>,
        read_at: std::time::SystemTime,
    ) -> Result<(), ConsumeError> {
        self.show(received, recorded, read_at)?;
        let ids: Vec<String> = received.iter().map(|(e, _)| e.id.clone()).collect();
        self.ack(&ids).await
    }

    /// Show what an inbox commit recorded (or found recorded) on every instance, and count
    /// it. Redeliveries are shown again: the first showing may never have happened (the
    /// previous writer killed between its commit and its hint); streams that sent them
    /// skip them by position.
    fn show(
        &self,
        received: &[(Entry, model::Message)],
        recorded: &HashMap<uuid::Uuid, Position>,
        read_at: std::time::SystemTime,
    ) -> Result<(), ConsumeError> {
        let metrics = &self.inbox.metrics;
        let committed = std::time::SystemTime::now();
        let committed_micros = committed
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let mut deliveries: HashMap<uuid::Uuid, Delivery> = HashMap::new();
        let mut shown: Vec<HistoryItem> = Vec::with_capacity(received.len());
        for (entry, message) in received {
            let Some(position) = recorded.get(&message.id) else {
                // Not written and not there: only a batch refused by a newer writer's epoch
                // does that, and it ends before getting here.
                return Err(ConsumeError::Reply(format!(
                    "message {} of entry {} has no feed position after the inbox commit",
                    message.id, entry.id
                )));
            };
            let fields = entry.fields.as_ref();
            let published = fields
                .and_then(|f| {
                    entry::EntryFields::decode(|name| f.get(name).map(String::as_str)).ok()
                })
                .and_then(|f| f.published_at());
            let given = entry.trace_context();
            let span = record_span(given.as_ref(), read_at, entry, message, position);
            deliveries.insert(
                message.id,
                Delivery {
                    recorded_at_micros: committed_micros,
                    traceparent: telemetry::passed_on(span.as_ref(), given.as_ref()),
                },
            );
            drop(span);
            if position.new {
                if let Some(published) = published {
                    metrics.published_to_recorded_seconds.observe(
                        committed
                            .duration_since(published)
                            .map_or(0.0, |d| d.as_secs_f64()),
                    );
                }
                metrics.messages_received_total.inc();
                #[cfg(feature = "failpoints")]
                if self.cfg().crash_after_inbox_commit
                    == Some(
                        self.inbox
                            .recorded
                            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                            + 1,
                    )
                {
                    error!(message_id = %message.id, "failpoint: crashing after the inbox commit, before XACK");
                    // SAFETY: signalling our own process.
                    unsafe {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                }
            } else {
                metrics.duplicates_skipped_total.inc();
                info!(message_id = %message.id, stream_id = %entry.id, trace_id = %entry.trace_id(), pos = position.pos, "redelivery of a message already in the inbox; shown again, recorded once");
            }
            shown.push(HistoryItem {
                message: message.clone(),
                pos: position.pos,
            });
        }
        shown.sort_by_key(|item| (item.message.chat_id, item.pos));
        shown.dedup_by_key(|item| item.message.id);
        for item in &shown {
            let delivery = deliveries.remove(&item.message.id);
            self.inbox.announcer.announce(item, delivery);
        }
        let now = time::OffsetDateTime::now_utc();
        for (entry, _) in received {
            let written = entry
                .fields
                .as_ref()
                .and_then(|f| f.get(entry::CREATED_AT))
                .and_then(|t| {
                    time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
                        .ok()
                });
            if let Some(written) = written {
                metrics
                    .delivery_seconds
                    .observe((now - written).as_seconds_f64().max(0.0));
            }
        }
        Ok(())
    }
}

/// The inbox write's span of one message: a child of the relay's publish span (the
/// entry's context), from the batch being read to its commit (ended when dropped).
fn record_span(
    parent: Option<&telemetry::SpanContext>,
    read_at: std::time::SystemTime,
    entry: &Entry,
    message: &model::Message,
    position: &Position,
) -> Option<telemetry::Span> {
    use telemetry::{Attribute, Kind};
    telemetry::start(
        "inbox record",
        Kind::Consumer,
        Some(parent?),
        Some(read_at),
        vec![
            Attribute::new("messaging.system", "redis"),
            Attribute::new("messaging.operation.type", "process"),
            Attribute::new("messaging.message.id", entry.id.clone()),
            Attribute::new("chat.message.id", message.id.to_string()),
            Attribute::new("chat.id", message.chat_id),
            Attribute::new("chat.inbox.duplicate", !position.new),
        ],
    )
}

enum Recorded {
    Done(HashMap<uuid::Uuid, Position>),
    Rejected(StoreError),
    Shutdown,
    /// The database is too busy for a batch this large: write it in smaller parts.
    TooLarge,
}
