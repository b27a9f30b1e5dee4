//! Watermarks: where the outbox table and the slot meet, so that a shard that fell behind can
//! be caught up from the table with neither a gap nor a fixed overlap.
//!
//! A watermark is a Postgres snapshot read between two WAL positions: `lo` (read before the
//! snapshot was taken) and `hi` (read after). No transaction whose commit record lies above
//! `hi` is visible in the snapshot; nearly every one below `lo` is. (Not quite all: a commit
//! is in the WAL a moment before snapshots show it, as long as a synchronous standby keeps it
//! waiting. The pipeline makes sure such a transaction is never dropped unseen; at worst one
//! of them is republished under a new id, which consumers deduplicate by `outbox_id`.) So
//! once a shard has acknowledged through an LSN `A >= hi`, the rows it may be missing later
//! are exactly those whose transaction the snapshot does not show, and the stream entries
//! that may already hold some of them have ids at or above `lo`. The relay takes one every second
//! ([`WATERMARK_INTERVAL`]) and records the newest one a shard's acknowledgement covers in
//! that shard's record, beside `acked_through`.
//!
//! Visibility is judged by the outbox row's `tx` column (`pg_current_xact_id()`, the
//! top-level transaction: a row written inside a savepoint is judged by its transaction, as a
//! snapshot lists only top-level ones), in SQL with `pg_visible_in_snapshot` and here with
//! [`Snapshot::visible`], which is the same rule.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgwire_replication::Lsn;
use tokio_postgres::Client;

use crate::error::RelayError;

/// How often the session takes a watermark.
pub(crate) const WATERMARK_INTERVAL: Duration = Duration::from_secs(1);
/// Watermarks the session keeps (the newest; acknowledgements pass a new one every second).
const KEPT: usize = 64;

/// A `pg_snapshot`: transactions below `xmin` are finished, those from `xmax` on had not
/// started, and of those between, the ones in `xip` were running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub(crate) xmin: u64,
    pub(crate) xmax: u64,
    pub(crate) xip: Vec<u64>,
}

impl Snapshot {
    /// Whether the snapshot shows what transaction `xid` (a full 64-bit id) committed:
    /// `pg_visible_in_snapshot`'s rule.
    pub(crate) fn visible(&self, xid: u64) -> bool {
        if xid < self.xmin {
            return true;
        }
        if xid >= self.xmax {
            return false;
        }
        self.xip.binary_search(&xid).is_err()
    }

    /// The full id of the 32-bit transaction id `xid` (what pgoutput's Begin carries) that
    /// runs near this snapshot: the one within 2^31 of `xmax`.
    pub(crate) fn widen(&self, xid: u32) -> u64 {
        let delta = xid.wrapping_sub(self.xmax as u32) as i32;
        self.xmax.wrapping_add_signed(i64::from(delta))
    }

    /// `pg_snapshot`'s text form, `xmin:xmax:xip,...`.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let mut parts = text.splitn(3, ':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let xip_text = parts.next()?;
        let mut xip: Vec<u64> = if xip_text.is_empty() {
            Vec::new()
        } else {
            xip_text
                .split(',')
                .map(|x| x.parse().ok())
                .collect::<Option<_>>()?
        };
        xip.sort_unstable();
        (xmin <= xmax).then_some(Self { xmin, xmax, xip })
    }
}

impl std::fmt::Display for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}:", self.xmin, self.xmax)?;
        for (i, x) in self.xip.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{x}")?;
        }
        Ok(())
    }
}

/// A snapshot between two WAL positions (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Watermark {
    /// Read before the snapshot: what committed below it is visible (see the module doc).
    pub(crate) lo: Lsn,
    /// Read after the snapshot: nothing committed above it is visible.
    pub(crate) hi: Lsn,
    /// When it was taken, by the server's clock (Unix microseconds).
    pub(crate) taken_at_micros: i64,
    pub(crate) snapshot: Snapshot,
}

impl Watermark {
    /// The record's form: `<lo>/<hi>/<taken at>/<snapshot>` (LSNs and the time as decimals).
    pub(crate) fn encode(&self) -> String {
        format!(
            "{}/{}/{}/{}",
            self.lo.as_u64(),
            self.hi.as_u64(),
            self.taken_at_micros,
            self.snapshot
        )
    }

    pub(crate) fn decode(text: &str) -> Option<Self> {
        let mut parts = text.splitn(4, '/');
        let lo = Lsn(parts.next()?.parse().ok()?);
        let hi = Lsn(parts.next()?.parse().ok()?);
        let taken_at_micros = parts.next()?.parse().ok()?;
        let snapshot = Snapshot::parse(parts.next()?)?;
        (lo <= hi).then_some(Self {
            lo,
            hi,
            taken_at_micros,
            snapshot,
        })
    }

    /// How long ago it was taken (by this machine's clock against the server's).
    pub(crate) fn age(&self) -> Duration {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as i64)
            .unwrap_or_default();
        Duration::from_micros((now - self.taken_at_micros).max(0) as u64)
    }
}

/// The server's WAL position: the insert position on a primary, what it replayed on a
/// standby (where a snapshot shows what it replayed).
const POSITION: &str = "(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                              ELSE pg_current_wal_insert_lsn() END - '0/0')::text";

/// Take a watermark on `client`: the position, then (in a second statement, whose snapshot
/// is taken when it starts) the snapshot and the position again.
pub(crate) async fn take(client: &Client) -> Result<Watermark, RelayError> {
    let lo: String = client
        .query_one(&format!("SELECT {POSITION}"), &[])
        .await?
        .get(0);
    let row = client
        .query_one(
            &format!(
                "SELECT pg_current_snapshot()::text, {POSITION},
                        (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
            ),
            &[],
        )
        .await?;
    let (snapshot, hi, taken_at_micros): (String, String, i64) =
        (row.get(0), row.get(1), row.get(2));
    let bad = |what: &str| RelayError::Protocol(format!("watermark: unreadable {what}"));
    let lsn = |text: &str| text.parse::<u64>().map(Lsn).map_err(|_| bad("position"));
    Ok(Watermark {
        lo: lsn(&lo)?,
        hi: lsn(&hi)?,
        taken_at_micros,
        snapshot: Snapshot::parse(&snapshot).ok_or_else(|| bad("snapshot"))?,
    })
}

/// Wait up to `within` until the server has flushed its WAL through `w.hi` (a standby: replayed
/// it). From then on every commit `w` shows survives a crash, and no transaction id it saw
/// end is given out again, so a record may keep it across restarts: held replays
/// (`recovery::takeover`) trust every recorded watermark on its timeline. `false`: not
/// flushed in time (WAL is flushed within the WAL writer's delay; this is a bound, not a wait
/// anyone expects).
pub(crate) async fn wait_durable(
    client: &Client,
    w: &Watermark,
    within: Duration,
) -> Result<bool, RelayError> {
    let deadline = tokio::time::Instant::now() + within;
    let mut nudged = false;
    loop {
        let flushed: String = client
            .query_one(
                "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                              ELSE pg_current_wal_flush_lsn() END - '0/0')::text",
                &[],
            )
            .await?
            .get(0);
        let flushed: u64 = flushed
            .parse()
            .map_err(|_| RelayError::Protocol("unreadable WAL flush position".into()))?;
        if flushed >= w.hi.as_u64() {
            return Ok(true);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(false);
        }
        if !nudged {
            // An idle server may never flush up to `hi`: the insert position of a record
            // that would start a page lies past the page's header, the flush stops at its
            // start. A commit of a transaction with an id flushes through its own record,
            // past `hi` (locally: no synchronous standby is waited for).
            // Refused (a read-only role): the flush still comes with the next writer's.
            nudged = true;
            if let Err(e) = client
                .batch_execute(
                    "BEGIN; SET LOCAL synchronous_commit = local;
                     SELECT pg_current_xact_id(); COMMIT",
                )
                .await
            {
                tracing::debug!(error = %e, "could not nudge a WAL flush");
                let _ = client.batch_execute("ROLLBACK").await;
            }
            continue;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The watermarks a session took, oldest first (shared by the task that takes them, the
/// streaming loop that records them with acknowledgements, and catch-ups).
#[derive(Clone, Default)]
pub(crate) struct Watermarks(Arc<Mutex<VecDeque<Arc<Watermark>>>>);

impl Watermarks {
    pub(crate) fn push(&self, watermark: Watermark) -> Arc<Watermark> {
        let watermark = Arc::new(watermark);
        let mut kept = self.0.lock().unwrap();
        // Taken by concurrent tasks: keep them ordered by `hi`.
        let at = kept.partition_point(|w| w.hi <= watermark.hi);
        kept.insert(at, watermark.clone());
        while kept.len() > KEPT {
            kept.pop_front();
        }
        watermark
    }

    /// The newest watermark taken (the highest `hi`).
    pub(crate) fn newest(&self) -> Option<Arc<Watermark>> {
        self.0.lock().unwrap().back().cloned()
    }

    /// The newest watermark an acknowledgement through `acked` covers (`hi <= acked`) whose
    /// `lo` is at least `floor` (taken entirely after a catch-up's last snapshot).
    pub(crate) fn covered_by(&self, acked: Lsn, floor: Lsn) -> Option<Arc<Watermark>> {
        let kept = self.0.lock().unwrap();
        kept.iter()
            .rev()
            .find(|w| w.hi <= acked && w.lo >= floor)
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visibility_follows_pg_visible_in_snapshot() {
        let s = Snapshot::parse("100:110:103,105").unwrap();
        assert!(s.visible(99));
        assert!(s.visible(100));
        assert!(!s.visible(103));
        assert!(s.visible(104));
        assert!(!s.visible(105));
        assert!(!s.visible(110));
        assert!(!s.visible(5000));
        assert_eq!(s.to_string(), "100:110:103,105");
        assert_eq!(Snapshot::parse("7:7:").unwrap().xip, Vec::<u64>::new());
        for bad in ["", "1", "1:2", "x:2:", "3:2:", "1:5:a"] {
            assert_eq!(Snapshot::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_32_bit_xid_widens_to_the_epoch_near_the_snapshot() {
        let epoch = 3u64 << 32;
        let s = Snapshot {
            xmin: epoch + 10,
            xmax: epoch + 20,
            xip: vec![],
        };
        assert_eq!(s.widen(15), epoch + 15);
        assert_eq!(s.widen(25), epoch + 25);
        // Just before the epoch turned over: the previous epoch.
        let s = Snapshot {
            xmin: epoch + 2,
            xmax: epoch + 5,
            xip: vec![],
        };
        assert_eq!(s.widen(u32::MAX - 3), epoch - 4);
    }

    #[test]
    fn a_watermark_round_trips_through_the_record() {
        let w = Watermark {
            lo: Lsn(1000),
            hi: Lsn(1200),
            taken_at_micros: 1_700_000_000_000_000,
            snapshot: Snapshot::parse("5:9:6,7").unwrap(),
        };
        assert_eq!(Watermark::decode(&w.encode()), Some(w));
        assert_eq!(Watermark::decode("1200/1000/0/5:9:"), None, "lo above hi");
        assert_eq!(Watermark::decode("garbage"), None);
    }

    #[test]
    fn an_acknowledgement_picks_the_newest_watermark_it_covers() {
        let ring = Watermarks::default();
        let at = |lo: u64, hi: u64| Watermark {
            lo: Lsn(lo),
            hi: Lsn(hi),
            taken_at_micros: 0,
            snapshot: Snapshot::parse("1:1:").unwrap(),
        };
        ring.push(at(10, 20));
        ring.push(at(40, 50));
        ring.push(at(25, 30)); // taken concurrently, pushed late
        assert_eq!(ring.covered_by(Lsn(15), Lsn(0)), None);
        assert_eq!(ring.covered_by(Lsn(35), Lsn(0)).unwrap().hi, Lsn(30));
        assert_eq!(ring.covered_by(Lsn(60), Lsn(0)).unwrap().hi, Lsn(50));
        // After a catch-up whose snapshot ended at 28: only those taken wholly after it.
        assert_eq!(ring.covered_by(Lsn(35), Lsn(28)), None);
        assert_eq!(ring.covered_by(Lsn(60), Lsn(28)).unwrap().hi, Lsn(50));
    }
}
