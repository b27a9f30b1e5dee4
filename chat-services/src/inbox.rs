//! The inbox consumer: the other side's stream in, each message recorded once in this
//! side's inbox, acknowledged, then shown to live SSE clients.
//!
//! Invariants:
//! - `XACK` only after the inbox transaction committed; a crash anywhere before it means
//!   redelivery, and the inbox (unique message id) absorbs the duplicate.
//! - Live clients are told only after the commit; the inbox is what they replay from, so a
//!   crash between commit and push hides nothing (clients resume with `Last-Event-ID`).
//! - One active consumer per side (a lease), reading in stream order, so messages are
//!   recorded and shown in the sender's commit order. On taking the lease it first claims
//!   every pending entry of the group and processes its own pending list in id order.
//! - An entry that cannot be parsed, or was delivered more than `max_deliveries` times
//!   without an acknowledgement, goes to the dead-letter stream with the reason, atomically
//!   with its `XACK`; it never blocks the entries after it. Postgres being down is not the
//!   entry's fault: the batch is retried in place and its delivery count does not grow.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use cdc_relay::backoff::{jitter, Backoff};
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Value};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::lease::Lease;
use crate::metrics::Metrics;
use crate::model::{self, HistoryItem};
use crate::notify::Announcer;
use crate::side::Side;
use crate::store::{Position, Received, Store, StoreError};

/// Entries read per call.
const READ_COUNT: usize = 100;
/// How long one blocking read waits for new entries.
const READ_BLOCK: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct InboxConfig {
    /// The receiving side (this service).
    pub side: Side,
    /// The stream read: the other side's outbox stream.
    pub stream: String,
    /// Consumer group: the receiving service's name.
    pub group: String,
    /// This instance's stable consumer name.
    pub consumer: String,
    pub dead_letter_stream: String,
    /// Dead letters kept at most (the oldest are trimmed beyond it).
    pub dead_letter_max_len: u64,
    /// Pending entries idle this long are claimed (from a consumer that died).
    pub claim_idle: Duration,
    /// Deliveries without acknowledgement after which an entry is dead-lettered.
    pub max_deliveries: u64,
    pub lease_ttl: Duration,
    /// Test hook: SIGKILL this process right after the n-th recorded message was committed
    /// to the inbox and before it is acknowledged.
    pub crash_after_inbox_commit: Option<u64>,
    /// Test hook: SIGKILL this process when about to record a message with this body.
    pub crash_on_body: Option<String>,
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
    pub role: ConsumerRole,
    pub redis_reachable: bool,
    pub last_error: Option<String>,
}

impl Default for ConsumerStatus {
    fn default() -> Self {
        Self {
            role: ConsumerRole::Starting,
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
}

/// A stream entry read from the group.
#[derive(Debug, Clone)]
struct Entry {
    id: String,
    /// `None`: the entry was trimmed from the stream before it was acknowledged.
    fields: Option<HashMap<String, String>>,
    deliveries: u64,
}

/// Whether a step ends because of shutdown.
enum Flow {
    Continue,
    Shutdown,
}

pub struct Inbox {
    cfg: InboxConfig,
    client: redis::Client,
    store: Store,
    announcer: Announcer,
    metrics: Arc<Metrics>,
    status: watch::Sender<ConsumerStatus>,
    /// This process's run, in attempt records: a record of another run means that run ended
    /// (crashed) while processing the entry.
    run_id: String,
    /// Messages recorded so far (for the `failpoints` crash hook).
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    recorded: AtomicU64,
}

impl Inbox {
    pub fn new(
        cfg: InboxConfig,
        client: redis::Client,
        store: Store,
        announcer: Announcer,
        metrics: Arc<Metrics>,
        status: watch::Sender<ConsumerStatus>,
    ) -> Self {
        Self {
            cfg,
            client,
            store,
            announcer,
            metrics,
            status,
            run_id: uuid::Uuid::new_v4().simple().to_string(),
            recorded: AtomicU64::new(0),
        }
    }

    fn set_role(&self, role: ConsumerRole) {
        self.metrics
            .consumer_active
            .set(i64::from(role == ConsumerRole::Active));
        self.status
            .send_if_modified(|s| std::mem::replace(&mut s.role, role) != role);
    }

    fn set_redis(&self, ok: bool, error: Option<String>) {
        self.status.send_if_modified(|s| {
            let changed = s.redis_reachable != ok || (error.is_some() && s.last_error != error);
            s.redis_reachable = ok;
            if error.is_some() {
                s.last_error = error.clone();
            }
            changed
        });
    }

    /// Consume until `shutdown`.
    pub async fn run(&self, shutdown: CancellationToken) {
        let lease = Lease::new(
            format!("inbox-lease:{}", self.cfg.side),
            &self.cfg.consumer,
            self.cfg.lease_ttl,
        );
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            match self.session(&lease, &shutdown).await {
                Ok(_) => break,
                Err(e) => {
                    let delay = backoff.next_delay();
                    if matches!(e, ConsumeError::Redis(_)) {
                        self.set_redis(false, Some(e.to_string()));
                    }
                    warn!(error = %e, retry_in = ?delay, "inbox consumer interrupted; retrying");
                    self.set_role(ConsumerRole::Starting);
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(delay) => {}
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
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_connection_timeout(Some(Duration::from_secs(3)))
            .set_number_of_retries(1);
        let mut conn = ConnectionManager::new_with_config(self.client.clone(), config).await?;
        let blocking = self
            .client
            .get_multiplexed_async_connection_with_config(
                &AsyncConnectionConfig::new()
                    .set_response_timeout(Some(READ_BLOCK + Duration::from_secs(5)))
                    .set_connection_timeout(Some(Duration::from_secs(3))),
            )
            .await?;
        self.set_redis(true, None);
        // Standby until the lease is ours.
        loop {
            if lease.acquire(&mut conn).await? {
                break;
            }
            if self.status.borrow().role != ConsumerRole::Standby {
                info!(consumer = %self.cfg.consumer, "another instance consumes the inbox; standing by");
            }
            self.set_role(ConsumerRole::Standby);
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(Flow::Shutdown),
                _ = tokio::time::sleep(jitter(lease.ttl() / 5)) => {}
            }
        }
        // Fence the previous holder where the writes land (it may be paused, not dead).
        let epoch = match self.store.claim_inbox_writer(&self.cfg.consumer).await {
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
        info!(consumer = %self.cfg.consumer, stream = %self.cfg.stream, group = %self.cfg.group, epoch, "inbox consumer active");
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
            in_flight: Vec::new(),
        };
        let result = active.consume(shutdown).await;
        active.release_in_flight().await;
        if let Err(e) = active.inbox.release(lease, &mut active.conn).await {
            debug!(error = %e, "could not release the lease");
        }
        result
    }

    async fn release(
        &self,
        lease: &Lease,
        conn: &mut ConnectionManager,
    ) -> Result<(), ConsumeError> {
        lease.release(conn).await?;
        Ok(())
    }
}

/// The consumer while it holds the lease.
struct Active<'a> {
    inbox: &'a Inbox,
    lease: &'a Lease,
    conn: ConnectionManager,
    blocking: MultiplexedConnection,
    renew_at: Instant,
    /// This holder's inbox-writer epoch; writes with an older one are refused.
    epoch: i64,
    /// Entries being processed, with their attempt numbers (see [`Active::attempts`]).
    in_flight: Vec<(String, u64)>,
}

impl Active<'_> {
    fn cfg(&self) -> &InboxConfig {
        &self.inbox.cfg
    }

    async fn consume(&mut self, shutdown: &CancellationToken) -> Result<Flow, ConsumeError> {
        self.ensure_group().await?;
        self.count_dead_letters().await?;
        // Holding the lease, nobody else consumes: everything pending in the group is ours
        // to finish, in id order, before anything new.
        self.claim(Duration::ZERO).await?;
        if let Flow::Shutdown = self.drain_own_pending(shutdown).await? {
            return Ok(Flow::Shutdown);
        }
        let claim_every = (self.cfg().claim_idle / 2).max(Duration::from_millis(100));
        let mut next_claim = Instant::now() + claim_every;
        loop {
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
            let entries = tokio::select! {
                _ = shutdown.cancelled() => return Ok(Flow::Shutdown),
                read = self.read(">") => read?,
            };
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
            if !entries.is_empty() {
                if let Flow::Shutdown = self.process(entries, shutdown).await? {
                    return Ok(Flow::Shutdown);
                }
            }
        }
    }

    /// Export the dead-letter stream's length (alerts fire while it is not empty).
    async fn count_dead_letters(&mut self) -> Result<(), ConsumeError> {
        let n: i64 = redis::cmd("XLEN")
            .arg(&self.cfg().dead_letter_stream)
            .query_async(&mut self.conn)
            .await?;
        self.inbox.metrics.dead_letter_entries.set(n);
        Ok(())
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

    async fn ensure_group(&mut self) -> Result<(), ConsumeError> {
        // From id 0: a group created after the relay already published misses nothing.
        let created: redis::RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.cfg().stream)
            .arg(&self.cfg().group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut self.conn)
            .await;
        match created {
            Ok(()) => {
                info!(stream = %self.cfg().stream, group = %self.cfg().group, "created consumer group");
                Ok(())
            }
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether entries other than `batch` were pending in the group (now claimed by this
    /// consumer): a paused previous holder's outstanding read can be served after this
    /// holder took over, and those entries precede the batch in the stream.
    async fn took_older_entries(&mut self, batch: &[Entry]) -> Result<bool, ConsumeError> {
        let claimed = self.claim_ids(Duration::ZERO).await?;
        let ours: std::collections::HashSet<&str> = batch.iter().map(|e| e.id.as_str()).collect();
        let others = claimed
            .iter()
            .filter(|id| !ours.contains(id.as_str()))
            .count();
        if others > 0 {
            info!(
                claimed = others,
                "entries delivered to a previous holder claimed; recording them first"
            );
        }
        Ok(others > 0)
    }

    /// XAUTOCLAIM every pending entry idle at least `min_idle` for this consumer (ids only:
    /// the delivery count grows when they are read). Returns how many were claimed.
    async fn claim(&mut self, min_idle: Duration) -> Result<usize, ConsumeError> {
        let claimed = self.claim_ids(min_idle).await?.len();
        if claimed > 0 {
            info!(claimed, min_idle = ?min_idle, "claimed pending entries");
        }
        Ok(claimed)
    }

    /// XAUTOCLAIM (JUSTID) every pending entry idle at least `min_idle`; the claimed ids.
    async fn claim_ids(&mut self, min_idle: Duration) -> Result<Vec<String>, ConsumeError> {
        let mut cursor = "0-0".to_string();
        let mut claimed = Vec::new();
        loop {
            let reply: Value = redis::cmd("XAUTOCLAIM")
                .arg(&self.cfg().stream)
                .arg(&self.cfg().group)
                .arg(&self.cfg().consumer)
                .arg(min_idle.as_millis() as u64)
                .arg(&cursor)
                .arg("COUNT")
                .arg(READ_COUNT)
                .arg("JUSTID")
                .query_async(&mut self.conn)
                .await?;
            let Value::Array(parts) = reply else {
                return Err(ConsumeError::Reply(format!("XAUTOCLAIM: {reply:?}")));
            };
            // Redis 7: [next cursor, claimed ids, deleted ids].
            let next: String = parts
                .first()
                .map(redis::from_redis_value_ref)
                .transpose()
                .map_err(|e| ConsumeError::Reply(e.to_string()))?
                .unwrap_or_else(|| "0-0".into());
            if let Some(Value::Array(ids)) = parts.get(1) {
                for id in ids {
                    claimed.push(
                        redis::from_redis_value_ref::<String>(id)
                            .map_err(|e| ConsumeError::Reply(e.to_string()))?,
                    );
                }
            }
            if let Some(Value::Array(deleted)) = parts.get(2) {
                if !deleted.is_empty() {
                    error!(count = deleted.len(), "pending entries were trimmed from the stream before being recorded; stream MAXLEN is too small for the consumer lag");
                    self.inbox
                        .metrics
                        .entries_lost_total
                        .inc_by(deleted.len() as u64);
                }
            }
            if next == "0-0" {
                break;
            }
            cursor = next;
        }
        Ok(claimed)
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

    /// XREADGROUP from `id` (`>`: new entries, blocking briefly; otherwise own pending
    /// entries after `id`, with their delivery counts).
    async fn read(&mut self, id: &str) -> Result<Vec<Entry>, ConsumeError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.cfg().group)
            .arg(&self.cfg().consumer)
            .arg("COUNT")
            .arg(READ_COUNT);
        if id == ">" {
            cmd.arg("BLOCK").arg(READ_BLOCK.as_millis() as u64);
        }
        cmd.arg("STREAMS").arg(&self.cfg().stream).arg(id);
        let reply: Value = cmd.query_async(&mut self.blocking).await?;
        let mut entries = parse_read_reply(reply)?;
        if id != ">" && !entries.is_empty() {
            let counts = self.delivery_counts(&entries).await?;
            for e in &mut entries {
                e.deliveries = counts.get(&e.id).copied().unwrap_or(1);
            }
        }
        Ok(entries)
    }

    async fn delivery_counts(
        &mut self,
        entries: &[Entry],
    ) -> Result<HashMap<String, u64>, ConsumeError> {
        let reply: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(&self.cfg().stream)
            .arg(&self.cfg().group)
            .arg(&entries[0].id)
            .arg(&entries[entries.len() - 1].id)
            .arg(entries.len())
            .arg(&self.cfg().consumer)
            .query_async(&mut self.conn)
            .await?;
        Ok(reply
            .ids
            .into_iter()
            .map(|p| (p.id, p.times_delivered as u64))
            .collect())
    }

    async fn process(
        &mut self,
        entries: Vec<Entry>,
        shutdown: &CancellationToken,
    ) -> Result<Flow, ConsumeError> {
        let mut received = Vec::new();
        let mut dead = Vec::new();
        let mut gone = Vec::new();
        let attempts = self.attempts(&entries).await?;
        self.in_flight = entries
            .iter()
            .map(|e| (e.id.clone(), attempts.get(&e.id).copied().unwrap_or(1)))
            .collect();
        for entry in entries {
            let Some(fields) = &entry.fields else {
                gone.push(entry.id);
                continue;
            };
            let attempt = attempts.get(&entry.id).copied().unwrap_or(1);
            if attempt > self.cfg().max_deliveries {
                let reason = format!(
                    "its processing ended with the consumer process {} times (limit {}; delivered {} times)",
                    attempt - 1,
                    self.cfg().max_deliveries,
                    entry.deliveries
                );
                dead.push((entry, reason));
                continue;
            }
            let parsed = match (fields.get("event"), fields.get("payload")) {
                (Some(event), Some(payload)) => {
                    model::parse_event(event, payload, self.cfg().side.other())
                }
                (None, _) => Err(model::PoisonError::MissingField("event")),
                (_, None) => Err(model::PoisonError::MissingField("payload")),
            };
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
            let recorded = match self.record(&batch, shutdown).await? {
                Recorded::Done(positions) => positions,
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
                        match self.record(&single, shutdown).await? {
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
            self.after_commit(&received, &recorded).await?;
        }
        for (entry, reason) in dead {
            self.dead_letter(&entry, &reason).await?;
        }
        self.in_flight.clear();
        Ok(Flow::Continue)
    }

    /// Each redelivered entry's attempt number: how many times processing it started and
    /// ended with the process that ran it (a crash), plus one. Redis's delivery count is not
    /// it: every session restart, handover and claim raises that, through no fault of the
    /// entry. A record `<run> <n>` per entry (in `inbox-attempts:<side>`) names the run
    /// processing it; a session that ends without finishing marks its entries released
    /// (`- <n>`). A record of another run (or none: first deliveries are attempt 1 and cost
    /// no record) that stays so for a lease TTL (a live holder notices a lost lease and
    /// releases well within that) was left by a run that ended while processing: that
    /// counts.
    async fn attempts(&mut self, entries: &[Entry]) -> Result<HashMap<String, u64>, ConsumeError> {
        let redelivered: Vec<&str> = entries
            .iter()
            .filter(|e| e.deliveries > 1)
            .map(|e| e.id.as_str())
            .collect();
        let mut attempts = HashMap::new();
        if redelivered.is_empty() {
            return Ok(attempts);
        }
        let key = attempts_key(self.cfg().side);
        let deadline = Instant::now() + self.lease.ttl();
        let records = loop {
            let records: Vec<Option<(String, u64)>> = redis::cmd("HMGET")
                .arg(&key)
                .arg(&redelivered)
                .query_async::<Vec<Option<String>>>(&mut self.conn)
                .await?
                .into_iter()
                .map(|r| {
                    let r = r?;
                    let (run, n) = r.split_once(' ')?;
                    Some((run.to_string(), n.parse::<u64>().ok()?))
                })
                .collect();
            // No record: processed by another run on its first delivery (which keeps no
            // record), like a record of another run: it ended, or has not released yet.
            let held_elsewhere = records.iter().any(|record| match record {
                None => true,
                Some((run, _)) => run != "-" && *run != self.inbox.run_id,
            });
            if !held_elsewhere || Instant::now() >= deadline {
                break records;
            }
            // A previous holder may still be noticing that it lost the lease.
            tokio::time::sleep(Duration::from_millis(200)).await;
            self.renew_if_due().await?;
        };
        let mut hset = redis::cmd("HSET");
        hset.arg(&key);
        for (id, record) in redelivered.iter().zip(records) {
            let n = match record {
                // Its first processing left no record and never finished: the process
                // ended during it.
                None => 2,
                Some((run, n)) if run == "-" || run == self.inbox.run_id => n,
                Some((_, n)) => n + 1,
            };
            hset.arg(*id).arg(format!("{} {n}", self.inbox.run_id));
            attempts.insert(id.to_string(), n);
        }
        let _: i64 = hset.query_async(&mut self.conn).await?;
        Ok(attempts)
    }

    /// Mark the entries this session was processing as released: their next processing is
    /// not a new attempt (best effort; if Redis cannot take it, the next one counts).
    async fn release_in_flight(&mut self) {
        if self.in_flight.is_empty() {
            return;
        }
        let mut hset = redis::cmd("HSET");
        hset.arg(attempts_key(self.cfg().side));
        for (id, n) in std::mem::take(&mut self.in_flight) {
            hset.arg(id).arg(format!("- {n}"));
        }
        let released: redis::RedisResult<i64> = hset.query_async(&mut self.conn).await;
        if let Err(e) = released {
            debug!(error = %e, "could not mark entries in flight as released");
        }
    }

    /// Insert into the inbox, retrying in place (keeping the lease, never counting a
    /// delivery) while Postgres is unavailable or its state refuses the write (read-only,
    /// permissions, a missing table, a lock): that is nobody's entry's fault. Only a row
    /// Postgres refuses for its own data comes back as `Rejected`.
    async fn record(
        &mut self,
        batch: &[Received],
        shutdown: &CancellationToken,
    ) -> Result<Recorded, ConsumeError> {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            match self.inbox.store.record_inbox(batch, self.epoch).await {
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
                    }
                    self.renew_if_due().await?;
                }
            }
        }
    }

    /// After the inbox commit: show, then acknowledge. Redeliveries are shown again: the
    /// first showing may never have happened (the previous writer killed between its commit
    /// and its hint); streams that sent them skip them by position.
    async fn after_commit(
        &mut self,
        received: &[(Entry, model::Message)],
        recorded: &HashMap<uuid::Uuid, Position>,
    ) -> Result<(), ConsumeError> {
        let metrics = &self.inbox.metrics;
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
            if position.new {
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
                info!(message_id = %message.id, stream_id = %entry.id, pos = position.pos, "redelivery of a message already in the inbox; shown again, recorded once");
            }
            shown.push(HistoryItem {
                message: message.clone(),
                pos: position.pos,
            });
        }
        shown.sort_by_key(|item| (item.message.chat_id, item.pos));
        shown.dedup_by_key(|item| item.message.id);
        for item in &shown {
            self.inbox.announcer.announce(item);
        }
        let now = time::OffsetDateTime::now_utc();
        for (entry, _) in received {
            let written = entry
                .fields
                .as_ref()
                .and_then(|f| f.get("created_at"))
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
        let ids: Vec<String> = received.iter().map(|(e, _)| e.id.clone()).collect();
        self.ack(&ids).await
    }

    async fn ack(&mut self, ids: &[String]) -> Result<(), ConsumeError> {
        // (A batch whose every entry was refused leaves nothing to acknowledge here; XACK
        // without ids is an error that would restart the session and count a delivery.)
        if ids.is_empty() {
            return Ok(());
        }
        let () = redis::pipe()
            .cmd("XACK")
            .arg(&self.cfg().stream)
            .arg(&self.cfg().group)
            .arg(ids)
            .ignore()
            .cmd("HDEL")
            .arg(attempts_key(self.cfg().side))
            .arg(ids)
            .ignore()
            .query_async(&mut self.conn)
            .await?;
        Ok(())
    }

    /// Move an entry to the dead-letter stream with its reason, atomically with its XACK.
    /// The stream is capped: what the cap trims is counted and logged.
    async fn dead_letter(&mut self, entry: &Entry, reason: &str) -> Result<(), ConsumeError> {
        let max_len = self.cfg().dead_letter_max_len;
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&self.cfg().dead_letter_stream)
            .arg("MAXLEN")
            .arg("=")
            .arg(max_len)
            .arg("*")
            .arg("stream")
            .arg(&self.cfg().stream)
            .arg("id")
            .arg(&entry.id)
            .arg("reason")
            .arg(reason)
            .arg("deliveries")
            .arg(entry.deliveries);
        if let Some(fields) = &entry.fields {
            for (k, v) in fields {
                xadd.arg(format!("entry.{k}")).arg(v);
            }
        }
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("XLEN")
            .arg(&self.cfg().dead_letter_stream)
            .add_command(xadd)
            .ignore()
            .cmd("XACK")
            .arg(&self.cfg().stream)
            .arg(&self.cfg().group)
            .arg(&entry.id)
            .ignore()
            .cmd("HDEL")
            .arg(attempts_key(self.cfg().side))
            .arg(&entry.id)
            .ignore();
        let (before,): (u64,) = pipe.query_async(&mut self.conn).await?;
        self.inbox.metrics.dead_lettered_total.inc();
        let trimmed = (before + 1).saturating_sub(max_len);
        if trimmed > 0 {
            self.inbox
                .metrics
                .dead_letters_trimmed_total
                .inc_by(trimmed);
            error!(trimmed, max_len, dead_letter_stream = %self.cfg().dead_letter_stream, "dead-letter stream full: its oldest entries were trimmed and can no longer be replayed; act on the dead letters (chat-service dead-letters) or raise --dead-letter-max-len");
        }
        self.count_dead_letters().await?;
        warn!(stream_id = %entry.id, %reason, dead_letter_stream = %self.cfg().dead_letter_stream, "entry dead-lettered");
        Ok(())
    }
}

/// The hash of attempt records (see [`Active::attempts`]).
fn attempts_key(side: Side) -> String {
    format!("inbox-attempts:{side}")
}

enum Recorded {
    Done(HashMap<uuid::Uuid, Position>),
    Rejected(StoreError),
    Shutdown,
}

/// Entries of an XREADGROUP reply (RESP2 arrays or RESP3 maps; `Nil` when the block timed out).
fn parse_read_reply(reply: Value) -> Result<Vec<Entry>, ConsumeError> {
    let streams = match reply {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(streams) => streams
            .into_iter()
            .filter_map(|s| match s {
                Value::Array(mut kv) if kv.len() == 2 => kv.pop(),
                _ => None,
            })
            .collect::<Vec<_>>(),
        Value::Map(streams) => streams.into_iter().map(|(_, v)| v).collect(),
        other => return Err(ConsumeError::Reply(format!("XREADGROUP: {other:?}"))),
    };
    let mut entries = Vec::new();
    for stream in streams {
        let Value::Array(items) = stream else {
            continue;
        };
        for item in items {
            let Value::Array(mut parts) = item else {
                return Err(ConsumeError::Reply("entry is not an array".into()));
            };
            if parts.len() != 2 {
                return Err(ConsumeError::Reply("entry is not [id, fields]".into()));
            }
            let fields = parts.pop().expect("two parts");
            let id: String = redis::from_redis_value(parts.pop().expect("two parts"))
                .map_err(|e| ConsumeError::Reply(e.to_string()))?;
            let fields = match fields {
                Value::Nil => None,
                other => Some(
                    redis::from_redis_value::<HashMap<String, String>>(other)
                        .map_err(|e| ConsumeError::Reply(e.to_string()))?,
                ),
            };
            entries.push(Entry {
                id,
                fields,
                deliveries: 1,
            });
        }
    }
    Ok(entries)
}
