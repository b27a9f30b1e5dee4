//! The decision before streaming, as a pure function of what was read: the slot (read
//! first), every shard's record (read second) and the server (its timeline history, WAL
//! position, and whether it is a standby).
//!
//! It rests on the record's invariant: Redis's `acked_through` ≥ the slot's
//! `confirmed_flush_lsn`, because every acknowledgement is recorded in Redis before the slot
//! hears it. Reading the slot first means an active relay acknowledging in between can only
//! raise Redis's side, so "Redis knows less than the slot" is never a false alarm.

use super::rebuild::Reason;
use crate::sink::StreamRecord;
use crate::source::{Origin, SlotInfo};

/// What to do with one shard (or, for the slot-wide ones, the whole stream) before streaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// The slot continues the shard: it is live from the start.
    Stream,
    /// Same, after recording the server's later timeline (the shard's history is a prefix).
    Adopt,
    /// The slot is ahead of the shard, or the shard lost data or its record: it starts
    /// behind, and a catch-up from the outbox table brings it level.
    Behind(Reason),
    /// The slot cannot continue the stream (lost, or missing after a failover, or on a
    /// history that forked below the stream): make it anew, every shard behind.
    Reslot(Reason),
    /// No slot and no record that says it existed: `setup` was not run.
    SlotMissing,
    /// The server is a standby, and the stream would need a slot made there: the name may
    /// point at it moments before its promotion (a failover under way). Waited for, never
    /// acted on (a standby's slots, records and writers are left alone).
    AwaitPromotion,
    /// The server is on an older timeline than the stream (the old primary after a
    /// failover): streaming from it would undo the newer history, so refuse.
    OlderTimeline,
}

/// Where the server's WAL stands, and whether it is a standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Server {
    pub lsn: u64,
    pub in_recovery: bool,
}

/// The decision for one shard, from the slot (read first), its record (read second) and
/// the server.
pub(crate) fn decide(
    slot: Option<&SlotInfo>,
    record: &StreamRecord,
    origin: &Origin,
    server: Server,
) -> Decision {
    match decide_on(slot, record, origin, server) {
        // Making the slot anew drops and creates it and marks every record: nothing a
        // standby may do, whatever its slot or the record say.
        Decision::Reslot(_) if server.in_recovery => Decision::AwaitPromotion,
        decision => decision,
    }
}

fn decide_on(
    slot: Option<&SlotInfo>,
    record: &StreamRecord,
    origin: &Origin,
    server: Server,
) -> Decision {
    let server_lsn = server.lsn;
    // First of all: a server whose whole history is an ancestor of the stream's is the old
    // primary; nothing it says (a lost slot, a marker) may rewrite the newer history. A
    // lower timeline number with other ancestors (a restore) is a history of its own.
    if record
        .timeline
        .is_some_and(|recorded| recorded > origin.timeline)
        && record
            .history
            .as_ref()
            .is_some_and(|h| is_ancestor(&origin.history, origin.timeline, h))
    {
        return Decision::OlderTimeline;
    }
    // Written by this system on an earlier timeline (or an equal number with other
    // ancestors), and the server is a primary now: a promoted standby or a restore, which has
    // no slot before failover slots. A pod that only restarts its relay container never
    // reruns `setup`, so the relay makes the slot itself. A standby (a cascading one, or one
    // not yet promoted) never takes the stream over.
    let failed_over = record.exists()
        && !server.in_recovery
        && record.timeline.is_some_and(|recorded| {
            recorded < origin.timeline
                || (recorded == origin.timeline && history_diverged(record, origin))
        });
    let Some(slot) = slot else {
        return match record.rebuilding {
            // A slot made anew was dropped and not yet created again.
            Some(_) => Decision::Reslot(Reason::Resumed),
            None if failed_over && forked_below_stream(record, origin, server_lsn) => {
                Decision::Reslot(Reason::Timeline)
            }
            None if failed_over => Decision::Reslot(Reason::Failover),
            None if server.in_recovery => Decision::AwaitPromotion,
            // The stream was streaming from a slot on this history and it is gone: dropped
            // (made anew only with `--on-lost-slot recover`, as a lost one is; the caller
            // says `SlotMissing` unless the record names the slot it was looked up by).
            None if record.exists() => Decision::Reslot(Reason::SlotDropped),
            None => Decision::SlotMissing,
        };
    };
    if slot.is_lost() {
        return Decision::Reslot(Reason::LostSlot);
    }
    if !record.exists() {
        return Decision::Behind(Reason::NoRecord);
    }
    if forked_below_stream(record, origin, server_lsn) {
        return Decision::Reslot(Reason::Timeline);
    }
    if record.rebuilding.is_some() {
        return Decision::Behind(Reason::Resumed);
    }
    // Entries the relay wrote are gone (the stream was deleted or restored from older data).
    if record.lost_entries() {
        return Decision::Behind(Reason::LostRedisData);
    }
    // The slot moved past what the shard recorded: it fell behind (or Redis lost data, or
    // the slot was made anew by `setup` on a promoted standby: the failover is the reason).
    let acked = record.acked_through.unwrap_or(0);
    if slot
        .confirmed_flush_lsn
        .is_some_and(|confirmed| acked < confirmed.as_u64())
    {
        return Decision::Behind(if failed_over {
            Reason::Failover
        } else {
            Reason::FellBehind
        });
    }
    if record.timeline != Some(origin.timeline) {
        return Decision::Adopt;
    }
    Decision::Stream
}

/// The slot-wide decision of a stream of shards: the most serious of each shard's that is
/// not the shard's own business (an old primary above all; then making the slot anew; then a
/// missing slot). `None`: every shard streams, adopts or starts behind on its own.
pub(crate) fn decide_slot(decisions: &[Decision]) -> Option<Decision> {
    let rank = |d: &Decision| match d {
        Decision::Stream | Decision::Adopt | Decision::Behind(_) => 0,
        Decision::SlotMissing | Decision::AwaitPromotion => 2,
        Decision::Reslot(_) => 3,
        Decision::OlderTimeline => 4,
    };
    decisions
        .iter()
        .copied()
        .filter(|d| rank(d) > 0)
        .max_by_key(rank)
}

/// How a shard's record's history relates to the server's (for a shard caught up later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShardHistory {
    Same,
    /// The server is on a later timeline whose history holds everything the shard has.
    Later,
    /// The histories forked below what the shard holds (or cannot be told apart).
    Forked,
    /// The server is the old primary of the shard's history.
    Older,
}

pub(crate) fn shard_history(record: &StreamRecord, origin: &Origin) -> ShardHistory {
    let recorded = record.timeline.unwrap_or(origin.timeline);
    if recorded > origin.timeline
        && record
            .history
            .as_ref()
            .is_some_and(|h| is_ancestor(&origin.history, origin.timeline, h))
    {
        return ShardHistory::Older;
    }
    if history_diverged(record, origin) {
        return ShardHistory::Forked;
    }
    if recorded == origin.timeline {
        ShardHistory::Same
    } else {
        ShardHistory::Later
    }
}

/// Whether the server's history (`history`, on `timeline`) is where `recorded` came from:
/// `recorded` switched away from `timeline`, and every ancestor the server has is one of
/// `recorded`'s, switched at the same LSN.
fn is_ancestor(
    history: &crate::source::TimelineHistory,
    timeline: u32,
    recorded: &crate::source::TimelineHistory,
) -> bool {
    recorded.switch_point(timeline).is_some()
        && history
            .switches
            .iter()
            .all(|(tli, lsn)| recorded.switch_point(*tli) == Some(*lsn))
}

/// Whether the stream holds entries this server's history does not: its history forked
/// below them, or its WAL ends before them.
fn forked_below_stream(record: &StreamRecord, origin: &Origin, server_lsn: u64) -> bool {
    history_diverged(record, origin) || written_through(record) > server_lsn
}

/// Whether the stream holds (or may hold) entries of a history the server no longer has:
/// the recorded timeline is not an ancestor of the server's, its switch point lies below
/// what the stream acknowledged, or the recorded ancestors differ from the server's.
fn history_diverged(record: &StreamRecord, origin: &Origin) -> bool {
    let recorded = record.timeline.unwrap_or(origin.timeline);
    // Ancestors must be the server's: equal timeline numbers of two restores differ here.
    let ancestors_differ = record.history.as_ref().is_some_and(|h| {
        h.switches
            .iter()
            .any(|(tli, lsn)| origin.history.switch_point(*tli) != Some(*lsn))
    });
    if recorded == origin.timeline {
        return ancestors_differ;
    }
    let Some(switch) = origin.history.switch_point(recorded) else {
        return true;
    };
    written_through(record) > switch || ancestors_differ
}

/// The highest LSN the stream holds anything of: what it acknowledged, or the commit LSN of
/// its top entry (a large transaction is published in chunks before its Commit is
/// acknowledged).
fn written_through(record: &StreamRecord) -> u64 {
    let acked = record.acked_through.unwrap_or(0);
    acked.max(record.top.commit_lsn.saturating_sub(record.id_offset))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::TimelineHistory;
    use outbox_core::stream::EntryId;
    use pgwire_replication::Lsn;

    fn slot(confirmed: u64) -> SlotInfo {
        SlotInfo {
            plugin: Some("pgoutput".into()),
            slot_type: "logical".into(),
            database: Some("chat".into()),
            active_pid: None,
            wal_status: Some("reserved".into()),
            confirmed_flush_lsn: Some(Lsn(confirmed)),
            invalidation_reason: None,
            failover: None,
            synced: None,
        }
    }

    fn record(acked: u64, timeline: u32) -> StreamRecord {
        StreamRecord {
            system_id: Some("7".into()),
            timeline: Some(timeline),
            history: Some(TimelineHistory::default()),
            acked_through: Some(acked),
            last_id: Some(EntryId {
                commit_lsn: 90,
                seq: 0,
            }),
            top: EntryId {
                commit_lsn: 90,
                seq: 0,
            },
            ..Default::default()
        }
    }

    const PRIMARY: Server = primary(500);

    const fn primary(lsn: u64) -> Server {
        Server {
            lsn,
            in_recovery: false,
        }
    }

    fn origin(timeline: u32, switches: &[(u32, u64)]) -> Origin {
        Origin {
            system_id: "7".into(),
            timeline,
            history: TimelineHistory {
                switches: switches.to_vec(),
            },
        }
    }

    #[test]
    fn redis_ahead_of_the_slot_streams_and_behind_it_catches_up() {
        let o = origin(1, &[]);
        assert_eq!(
            decide(Some(&slot(100)), &record(100, 1), &o, PRIMARY),
            Decision::Stream
        );
        // The active relay acknowledged after we read the slot: Redis is ahead; fine.
        assert_eq!(
            decide(Some(&slot(100)), &record(150, 1), &o, PRIMARY),
            Decision::Stream
        );
        assert_eq!(
            decide(Some(&slot(100)), &record(99, 1), &o, PRIMARY),
            Decision::Behind(Reason::FellBehind)
        );
        let mut lost_entries = record(100, 1);
        lost_entries.top = EntryId::default();
        assert_eq!(
            decide(Some(&slot(100)), &lost_entries, &o, PRIMARY),
            Decision::Behind(Reason::LostRedisData)
        );
    }

    #[test]
    fn a_promoted_standby_without_the_slot_is_rebuilt_whether_it_had_the_stream_or_not() {
        // Timeline 1 switched to 2 at 300: the standby had everything acknowledged (100).
        let promoted = origin(2, &[(1, 300)]);
        assert_eq!(
            decide(None, &record(100, 1), &promoted, PRIMARY),
            Decision::Reslot(Reason::Failover)
        );
        // ... it switched at 80, below what the stream acknowledged: the stream holds
        // entries the new primary never had.
        assert_eq!(
            decide(None, &record(100, 1), &origin(2, &[(1, 80)]), PRIMARY),
            Decision::Reslot(Reason::Timeline)
        );
        // `setup` made the slot there first (ahead of what Redis acknowledged): the failover
        // is the reason, not Redis.
        assert_eq!(
            decide(Some(&slot(400)), &record(100, 1), &promoted, PRIMARY),
            Decision::Behind(Reason::Failover)
        );
        // A standby on the later timeline (cascading, or the relay decoding there) never
        // takes the stream over.
        let standby = Server {
            lsn: 500,
            in_recovery: true,
        };
        assert_eq!(
            decide(None, &record(100, 1), &promoted, standby),
            Decision::AwaitPromotion
        );
        // ... and neither does a standby still on the stream's own timeline (the name was
        // switched to it before its promotion): it is waited for.
        assert_eq!(
            decide(None, &record(100, 1), &origin(1, &[]), standby),
            Decision::AwaitPromotion
        );
        // ... nor one whose slot was lost, or whose slot went while a slot was being made
        // anew: a standby never makes the slot.
        let mut lost = slot(100);
        lost.wal_status = Some("lost".into());
        let mut marked = record(100, 1);
        marked.rebuilding = Some(Default::default());
        for (slot, record) in [(Some(&lost), record(100, 1)), (None, marked.clone())] {
            assert_eq!(
                decide(slot, &record, &origin(1, &[]), standby),
                Decision::AwaitPromotion
            );
        }
        // A relay decoding on the standby with its own slot catches a shard that fell
        // behind up from the standby's table, like anywhere else.
        assert_eq!(
            decide(Some(&slot(100)), &marked, &origin(1, &[]), standby),
            Decision::Behind(Reason::Resumed)
        );
        assert_eq!(
            decide(Some(&slot(400)), &record(100, 1), &origin(1, &[]), standby),
            Decision::Behind(Reason::FellBehind)
        );
        // A restore that reused the timeline number on another history is a new history too.
        let mut other = record(100, 2);
        other.history = Some(TimelineHistory {
            switches: vec![(1, 90)],
        });
        assert_eq!(
            decide(None, &other, &origin(2, &[(1, 95)]), PRIMARY),
            Decision::Reslot(Reason::Timeline)
        );
        // Same timeline, no slot: somebody dropped it; made anew like a lost one.
        assert_eq!(
            decide(None, &record(100, 2), &promoted, PRIMARY),
            Decision::Reslot(Reason::SlotDropped)
        );
        // The old primary, whatever it lacks, rewrites nothing.
        let mut newer = record(100, 2);
        newer.history = Some(TimelineHistory {
            switches: vec![(1, 80)],
        });
        assert_eq!(
            decide(None, &newer, &origin(1, &[]), PRIMARY),
            Decision::OlderTimeline
        );
        // A restore onto timeline 2 of another history ([(1, c)]) while the stream was
        // recorded on 3 after [(1, a), (2, b)]: not the old primary, but a history of its
        // own, so the stream is rebuilt from it.
        let mut recorded = record(100, 3);
        recorded.history = Some(TimelineHistory {
            switches: vec![(1, 60), (2, 95)],
        });
        assert_eq!(
            decide(Some(&slot(50)), &recorded, &origin(2, &[(1, 70)]), PRIMARY),
            Decision::Reslot(Reason::Timeline)
        );
        assert_eq!(
            decide(Some(&slot(50)), &recorded, &origin(2, &[(1, 60)]), PRIMARY),
            Decision::OlderTimeline
        );
    }

    #[test]
    fn no_record_a_marker_or_no_slot_decide_before_anything_else() {
        let o = origin(1, &[]);
        assert_eq!(
            decide(Some(&slot(100)), &StreamRecord::default(), &o, PRIMARY),
            Decision::Behind(Reason::NoRecord)
        );
        assert_eq!(
            decide(None, &record(100, 1), &o, PRIMARY),
            Decision::Reslot(Reason::SlotDropped)
        );
        // No record either: `setup` was never run.
        assert_eq!(
            decide(None, &StreamRecord::default(), &o, PRIMARY),
            Decision::SlotMissing
        );
        let mut marked = record(100, 1);
        marked.rebuilding = Some("lost_slot".into());
        assert_eq!(
            decide(None, &marked, &o, PRIMARY),
            Decision::Reslot(Reason::Resumed)
        );
        let mut lost = slot(100);
        lost.wal_status = Some("lost".into());
        assert_eq!(
            decide(Some(&lost), &record(100, 1), &o, PRIMARY),
            Decision::Reslot(Reason::LostSlot)
        );
        // Any reason the server gives (here 18's idle timeout) is a lost slot, whatever
        // wal_status says.
        let mut idle = slot(100);
        idle.invalidation_reason = Some("idle_timeout".into());
        assert_eq!(
            decide(Some(&idle), &record(100, 1), &o, PRIMARY),
            Decision::Reslot(Reason::LostSlot)
        );
    }

    #[test]
    fn a_new_timeline_is_adopted_only_when_it_forked_after_what_the_stream_acknowledged() {
        // Promoted standby that had everything: adopt.
        assert_eq!(
            decide(
                Some(&slot(100)),
                &record(100, 1),
                &origin(2, &[(1, 120)]),
                PRIMARY
            ),
            Decision::Adopt
        );
        // Standby behind what the stream acknowledged: rebuild.
        assert_eq!(
            decide(
                Some(&slot(50)),
                &record(100, 1),
                &origin(2, &[(1, 80)]),
                PRIMARY
            ),
            Decision::Reslot(Reason::Timeline)
        );
        // The server is on an ancestor of the stream's timeline: the old primary. Refuse,
        // even with a marker.
        let mut newer = record(100, 3);
        newer.history = Some(TimelineHistory {
            switches: vec![(1, 80), (2, 95)],
        });
        newer.rebuilding = Some("timeline".into());
        assert_eq!(
            decide(Some(&slot(50)), &newer, &origin(2, &[(1, 80)]), PRIMARY),
            Decision::OlderTimeline
        );
        // A lower timeline number that is no ancestor (a restore without the archive's
        // later history files) is a new history: rebuild.
        assert_eq!(
            decide(
                Some(&slot(50)),
                &record(100, 3),
                &origin(2, &[(1, 80)]),
                PRIMARY
            ),
            Decision::Reslot(Reason::Timeline)
        );
        // Recorded timeline not an ancestor of the server's.
        assert_eq!(
            decide(
                Some(&slot(50)),
                &record(100, 2),
                &origin(3, &[(1, 80)]),
                PRIMARY
            ),
            Decision::Reslot(Reason::Timeline)
        );
        // A large transaction's chunks sit above what was acknowledged: they count.
        let mut chunked = record(100, 1);
        chunked.top.commit_lsn = 130;
        assert_eq!(
            decide(Some(&slot(100)), &chunked, &origin(2, &[(1, 120)]), PRIMARY),
            Decision::Reslot(Reason::Timeline)
        );
        // Same timeline number, another history (two restores): diverged.
        let mut other = record(100, 2);
        other.history = Some(TimelineHistory {
            switches: vec![(1, 90)],
        });
        assert_eq!(
            decide(Some(&slot(100)), &other, &origin(2, &[(1, 95)]), PRIMARY),
            Decision::Reslot(Reason::Timeline)
        );
        // WAL ends before what the stream acknowledged (restored, same timeline).
        assert_eq!(
            decide(
                Some(&slot(50)),
                &record(100, 1),
                &origin(1, &[]),
                primary(60)
            ),
            Decision::Reslot(Reason::Timeline)
        );
        // Recorded ancestors differ from the server's.
        let mut r = record(100, 2);
        r.history = Some(TimelineHistory {
            switches: vec![(1, 70)],
        });
        assert_eq!(
            decide(
                Some(&slot(100)),
                &r,
                &origin(3, &[(1, 60), (2, 200)]),
                PRIMARY
            ),
            Decision::Reslot(Reason::Timeline)
        );
    }
}
