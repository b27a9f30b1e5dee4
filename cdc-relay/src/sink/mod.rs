//! Redis, where every message goes: batches of stream entries ([`batch`]), written by one
//! idempotent script call per part (`publisher`, `publish.lua`) through an ordered pipeline
//! of one lane per shard that confirms strictly in order and lets a shard that cannot
//! confirm fall behind (`pipeline`, `lane`); the stream's record (`record`) and the rebuild
//! lock (`rebuild_lock`). Every script is a Redis function ([`functions`]).

mod batch;
pub(crate) mod functions;
mod lane;
pub(crate) mod layout;
mod pipeline;
mod publisher;
mod rebuild_lock;
mod record;

pub(crate) use batch::{Batch, PublishSpan, StreamEntry, PG_EPOCH_OFFSET_MICROS};
pub(crate) use pipeline::{Confirmed, Event, Pipeline, Sealed, MAX_UNSEEN};
pub(crate) use publisher::{PartMeta, Publisher};
pub(crate) use rebuild_lock::RebuildLock;
pub(crate) use record::{
    offset_above, read_all, NewRecord, Records, StreamRecord, CATCH_UP_EVERYTHING, CATCH_UP_SINCE,
};
