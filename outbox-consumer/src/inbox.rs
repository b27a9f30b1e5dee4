//! What the application gives the consumer: its [`Inbox`] (decode an entry, record a batch
//! under the shard's [`Fence`] in one transaction, act after the commit), and what it
//! answers ([`RecordError`], classified once: whose fault, and what the consumer does).
//!
//! Invariants the consumer keeps, so the application need not:
//! - [`Inbox::record`] is called with entries in stream order, and an entry is acknowledged
//!   only after the call that recorded it returned `Ok` and [`Inbox::committed`] ran;
//! - a batch is retried in place, never counted as a delivery, for every error but
//!   [`RecordError::Refused`] (the data's fault: the batch is retried entry by entry and the
//!   refused entry dead-lettered) and [`RecordError::Fenced`] (another instance holds the
//!   shard: this one stands down, the entries stay pending for it).
//!
//! The application keeps one: **every write of [`Inbox::record`] checks the fence in the
//! same transaction** (see [`crate::fence`]), and records each entry at most once (by what
//! its payload identifies: after a relay's rebuild an entry may come again under a new id).

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use outbox_core::stream::entry;

/// A stream entry read from the consumer group.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The entry's stream id (`<commit LSN>-<k>`).
    pub id: String,
    /// Its fields whose values are UTF-8 text; `None`: it was trimmed from the stream
    /// before it was acknowledged (the consumer counts it lost and never hands it to the
    /// application).
    pub fields: Option<HashMap<String, String>>,
    /// Its fields whose values are not UTF-8 (a bytea payload is published as its bytes):
    /// read them with [`Entry::field_bytes`].
    pub binary: HashMap<String, Vec<u8>>,
    /// How often the group delivered it (Redis's count: restarts and claims raise it too).
    pub deliveries: u64,
}

impl Entry {
    /// One field's value.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields.as_ref()?.get(name).map(String::as_str)
    }

    /// One field's value as bytes, text or not.
    pub fn field_bytes(&self, name: &str) -> Option<&[u8]> {
        self.field(name)
            .map(str::as_bytes)
            .or_else(|| self.binary.get(name).map(Vec::as_slice))
    }

    /// The entry's key (the outbox mapping's key column), which picked its shard.
    pub fn key(&self) -> Option<&str> {
        self.field(entry::KEY)
    }

    /// The contract's fields of the entry (`event` and `payload` required as text: an
    /// entry whose payload is bytes says `payload` is missing; read it with
    /// [`Entry::field_bytes`]).
    pub fn decode(&self) -> Result<entry::EntryFields<'_>, entry::MissingField> {
        entry::EntryFields::decode(|name| self.field(name))
    }

    /// The trace context the entry carries, if valid.
    pub fn trace_context(&self) -> Option<outbox_core::telemetry::SpanContext> {
        outbox_core::telemetry::parse(self.field(entry::TRACEPARENT)?)
    }

    /// The trace id for log lines of this entry (empty without one).
    pub fn trace_id(&self) -> String {
        outbox_core::telemetry::trace_id(None, self.trace_context().as_ref())
    }
}

/// The shard's fence: the epoch this consumer claimed for its shard when it took the lease
/// ([`Inbox::claim_fence`]). A write must check, in its own transaction, that the shard's
/// epoch is still this one; a holder paused past its lease then writes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    pub shard: u32,
    pub epoch: i64,
}

/// Why recording failed, classified once: the consumer's answer to each is fixed. Each
/// carries the application's own words (logged, and a `Refused` one is the dead letter's
/// reason).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Another instance claimed the shard's fence since: nothing was written. The consumer
    /// stands down; the entries stay pending for the new holder.
    #[error("another instance holds the shard's fence (epoch {current}, ours {ours})")]
    Fenced { ours: i64, current: i64 },
    /// The database refused a row for its own data (a data exception, a constraint): the
    /// entry's fault. A batch is then recorded entry by entry, and the refused one
    /// dead-lettered with this reason.
    #[error("{0}")]
    Refused(String),
    /// The database answered too slowly for a batch this large (a statement or lock wait
    /// ran out): the batch is written in halves.
    #[error("{0}")]
    Busy(String),
    /// The database cannot be reached: retried in place (counted as `unavailable`).
    #[error("{0}")]
    Unavailable(String),
    /// The database's state refuses the write (read-only, a permission, a missing table):
    /// retried in place (counted as `database_state`); nobody's entry's fault.
    #[error("{0}")]
    State(String),
}

impl RecordError {
    /// Whether retrying later can succeed without anyone changing anything.
    pub fn is_transient(&self) -> bool {
        matches!(self, RecordError::Unavailable(_) | RecordError::Busy(_))
    }
}

/// The application's side of the receiving protocol. One value serves every shard; its
/// methods are called from one task per held shard.
pub trait Inbox: Send + Sync + 'static {
    /// An entry as the application understands it.
    type Item: Clone + Send + Sync + 'static;
    /// What a recording returns to [`Inbox::committed`] (positions, ids assigned).
    type Recorded: Send;

    /// Decode an entry. `Err(reason)`: it can never be recorded, and is dead-lettered
    /// with the reason (it never blocks the entries after it).
    fn decode(&self, entry: &Entry) -> Result<Self::Item, String>;

    /// The unit of order an entry belongs to (a chat, an aggregate), read cheaply; `None`:
    /// none. Through a backlog the consumer records ahead of its reads the entries whose
    /// unit has nothing older unprocessed, so a quiet unit is not held behind another's
    /// burst; entries without a unit wait for their turn in stream order. By default none.
    fn order_key(&self, entry: &Entry) -> Option<i64> {
        let _ = entry;
        None
    }

    /// Claim `shard`'s fence for `consumer` (it just took the shard's lease): make every
    /// previous holder's later write fail its fence check, and return the new epoch
    /// ([`crate::fence::FenceTable::claim`] does it on Postgres).
    fn claim_fence(
        &self,
        consumer: &str,
        shard: u32,
    ) -> impl Future<Output = Result<i64, RecordError>> + Send;

    /// Record `batch` (in stream order) in one transaction that checks `fence` first; each
    /// entry once (a redelivery finds its first recording). Called again with the same
    /// entries after any error but `Refused`, `Fenced` and `Busy` (then with halves of
    /// them). Bound every statement (`statement_timeout`, `lock_timeout`): a write that
    /// waits without end stalls its shard, and only an answer in time says `Busy`.
    fn record(
        &self,
        batch: &[(Entry, Self::Item)],
        fence: Fence,
    ) -> impl Future<Output = Result<Self::Recorded, RecordError>> + Send;

    /// After the commit of `batch` (read from Redis at `read_at`), before it is
    /// acknowledged: show it, count it. An `Err` restarts the shard's session (the batch is
    /// delivered again).
    fn committed(
        &self,
        batch: &[(Entry, Self::Item)],
        recorded: Self::Recorded,
        read_at: std::time::SystemTime,
    ) -> Result<(), String>;

    /// Which of these items the application holds already (same order). Asked of entries
    /// past their last delivery before they are dead-lettered: a run killed after its
    /// commit and before its acknowledgement recorded them, so they are acknowledged
    /// instead. By default none (then such an entry is dead-lettered, and its replay is
    /// absorbed as a duplicate).
    fn holds(
        &self,
        items: &[&Self::Item],
    ) -> impl Future<Output = Result<Vec<bool>, RecordError>> + Send {
        let none = vec![false; items.len()];
        async move { Ok(none) }
    }

    /// Whether this instance can record now (a cheap query, within `deadline`). An instance
    /// that cannot while another can leaves the member set, and its shards move.
    fn ping(&self, deadline: Duration) -> impl Future<Output = Result<(), RecordError>> + Send;

    /// Resolves when the database answers again after failing: retries then go at once,
    /// instead of a backoff later. By default never.
    fn answering_again(&self) -> impl Future<Output = ()> + Send + '_ {
        std::future::pending()
    }

    /// This instance now holds `shard` (its fence claimed): whatever a previous holder
    /// recorded and never showed may be shown now. By default nothing.
    fn took_shard(&self, shard: u32) {
        let _ = shard;
    }
}
