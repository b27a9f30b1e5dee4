//! A batch of stream entries on its way to Redis, and the acknowledgement it earns.
//!
//! Entries of many transactions ride in one batch (natural batching: the batch is sealed
//! whenever no more replication events are waiting, or it is full). A batch carries the
//! `end_lsn` of the last transaction whose Commit arrived before it was sealed: once Redis
//! confirmed this batch and every batch before it, the slot may be acknowledged there.
//! Entries of a transaction still open at sealing time ride along (they are idempotent) but
//! earn no acknowledgement until a later batch carries their Commit.

use std::sync::{Arc, Mutex};

use outbox_core::stream::EntryId;
use outbox_core::telemetry;
use pgwire_replication::Lsn;

use crate::config::BatchLimits;
use crate::decode::OutboxEvent;

/// Microseconds between the Unix epoch and the Postgres epoch (2000-01-01), in which
/// commit times come.
pub(crate) const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

#[derive(Debug, Clone)]
pub(crate) struct StreamEntry {
    pub id: EntryId,
    /// The shard whose stream gets this entry (see `shard`).
    pub shard: u32,
    pub event: OutboxEvent,
    /// Its transaction's commit time (Postgres epoch microseconds; 0 when republished), for
    /// the commit-to-published latency.
    pub commit_time_micros: i64,
    /// The relay's span of this entry, when it makes spans and the row had trace context.
    pub span: Option<PublishSpan>,
    /// Its transaction (32 bits, as pgoutput's Begin says; 0 when published from the outbox
    /// table): a catch-up's last snapshot decides by it whether the entry is already in the
    /// shard (see `recovery::catch_up`).
    pub xid: u32,
    /// Its row's value of the mapping's order column, when published from the outbox
    /// table: a catch-up's progress is recorded by it.
    pub order: Option<i64>,
    /// A logical decoding message: no table holds it, so no catch-up can bring it back; a
    /// lane never drops one (see `pipeline`), and no snapshot says it was published.
    pub tableless: bool,
}

impl StreamEntry {
    /// What the entry costs in memory and in a Redis call.
    pub(crate) fn bytes(&self) -> usize {
        self.event.encoded_len() + 24
    }
}

/// The relay's span of one entry, from its commit to Redis confirming it: shared by the
/// copies of the entry a retry makes, ended once, at the confirmation. A session that ends
/// first drops it, which ends it there, marked as not confirmed.
#[derive(Debug, Clone)]
pub(crate) struct PublishSpan(Arc<Mutex<Unconfirmed>>);

#[derive(Debug)]
struct Unconfirmed(Option<telemetry::Span>);

impl Drop for Unconfirmed {
    fn drop(&mut self) {
        use telemetry::SpanExt as _;
        if let Some(span) = &mut self.0 {
            span.set_status(telemetry::Status::error(
                "the session ended before Redis confirmed the entry (the next session publishes it again)",
            ));
        }
    }
}

impl PublishSpan {
    pub(crate) fn new(span: telemetry::Span) -> Self {
        Self(Arc::new(Mutex::new(Unconfirmed(Some(span)))))
    }

    /// Redis confirmed the entry.
    pub(crate) fn end(&self) {
        use telemetry::SpanExt as _;
        if let Some(mut span) = self.0.lock().unwrap().0.take() {
            span.end();
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Batch {
    pub entries: Vec<StreamEntry>,
    bytes: usize,
    /// `end_lsn` of the last transaction completed in this batch, if any.
    pub ack_lsn: Option<Lsn>,
    /// Commit timestamps (Postgres epoch microseconds) of the transactions with entries in
    /// this batch, for the commit-to-published latency.
    pub commit_times_micros: Vec<i64>,
}

impl Batch {
    /// Add an entry of the transaction committed at `commit_time_micros`.
    pub(crate) fn push(&mut self, mut entry: StreamEntry, commit_time_micros: i64) {
        entry.commit_time_micros = commit_time_micros;
        let first_of_transaction = self
            .entries
            .last()
            .is_none_or(|last| last.id.commit_lsn != entry.id.commit_lsn);
        if first_of_transaction {
            self.commit_times_micros.push(commit_time_micros);
        }
        self.bytes += entry.bytes();
        self.entries.push(entry);
    }

    /// Record that a transaction ended: once this batch is confirmed, the slot may be
    /// acknowledged at its `end_lsn`.
    pub(crate) fn complete_transaction(&mut self, end_lsn: Lsn) {
        self.ack_lsn = Some(self.ack_lsn.map_or(end_lsn, |lsn| lsn.max(end_lsn)));
    }

    pub(crate) fn has_room(&self, limits: &BatchLimits) -> bool {
        self.entries.len() < limits.max_entries && self.bytes < limits.max_bytes
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.ack_lsn.is_none()
    }

    pub(crate) fn has_entries(&self) -> bool {
        !self.entries.is_empty()
    }

    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use bytes::Bytes;

    pub(crate) fn entry(lsn: u64, seq: u64) -> StreamEntry {
        StreamEntry {
            id: EntryId {
                commit_lsn: lsn,
                seq,
            },
            shard: 0,
            commit_time_micros: 0,
            event: OutboxEvent {
                outbox_id: Bytes::from_static(b"1"),
                event: Bytes::from_static(b"e"),
                payload: Bytes::from_static(b"{}"),
                created_at: None,
                key: None,
                traceparent: None,
                extra: Vec::new(),
                route: None,
            },
            span: None,
            xid: 0,
            order: None,
            tableless: false,
        }
    }

    #[test]
    fn room_is_bounded_by_entries_and_bytes() {
        let limits = BatchLimits {
            max_entries: 2,
            max_bytes: 1 << 20,
        };
        let mut batch = Batch::default();
        assert!(batch.is_empty() && batch.has_room(&limits));
        batch.push(entry(1, 0), 10);
        assert!(batch.has_room(&limits));
        batch.push(entry(1, 1), 10);
        assert!(!batch.has_room(&limits));
        assert_eq!(
            batch.commit_times_micros,
            [10],
            "one transaction, one commit time"
        );

        let limits = BatchLimits {
            max_entries: 100,
            max_bytes: 50,
        };
        let mut batch = Batch::default();
        batch.push(entry(1, 0), 10);
        assert!(!batch.has_room(&limits), "{} bytes", batch.bytes());
    }

    #[test]
    fn a_commit_without_entries_still_earns_an_acknowledgement() {
        let mut batch = Batch::default();
        batch.complete_transaction(Lsn(100));
        assert!(!batch.is_empty());
        assert!(!batch.has_entries());
        assert_eq!(batch.ack_lsn, Some(Lsn(100)));
    }
}
