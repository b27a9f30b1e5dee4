//! Postgres, where every message starts: the slot (its SQL in one place), the
//! prerequisites checked before each session, the replication connection and what its
//! errors mean, and the server's identity and timeline history.

mod prerequisites;
mod replication;
mod slot;
mod timeline;

pub(crate) use prerequisites::check_prerequisites;
pub(crate) use replication::{replication_config, replication_error, ReplicationPhase};
pub(crate) use slot::{
    check_slot, confirmed_flush, create_exporting_snapshot, create_slot, drop_slot, make_failover,
    read_slots, read_standby_copy, slot_info, NewSlot, SlotHealth, SlotInfo,
};
pub(crate) use timeline::{Origin, TimelineHistory};
