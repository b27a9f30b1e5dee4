//! Postgres, where every message starts: the slot (its SQL in one place), the
//! prerequisites checked before each session, the replication connection and what its
//! errors mean, the server's identity and timeline history, and watermarks (snapshots
//! between WAL positions) that tie the outbox table to the slot.

mod prerequisites;
mod replication;
mod slot;
mod timeline;
mod watermark;

pub(crate) use prerequisites::{check_effective_wal_level, check_prerequisites};
pub(crate) use replication::{replication_config, replication_error, ReplicationPhase};
pub(crate) use slot::{
    check_slot, confirmed_flush, create_slot, create_slot_on_session, drop_slot, make_failover,
    read_slots, read_standby_copy, slot_info, SlotHealth, SlotInfo,
};
pub(crate) use timeline::{Origin, TimelineHistory};
pub(crate) use watermark::{
    take as take_watermark, wait_durable, Snapshot, Watermark, Watermarks, WATERMARK_INTERVAL,
};
