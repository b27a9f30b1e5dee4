//! Redis, where every message goes: batches of stream entries ([`batch`]), written by one
//! idempotent script call per batch and shard ([`publisher`], `publish.lua`) through an
//! ordered pipeline that confirms batches strictly in order ([`pipeline`]); the stream's
//! record ([`record`]) and the rebuild lock ([`rebuild_lock`]).

mod batch;
mod pipeline;
mod publisher;
mod rebuild_lock;
mod record;

pub(crate) use batch::{Batch, PublishSpan, StreamEntry};
pub(crate) use pipeline::{Confirmed, Pipeline};
pub(crate) use publisher::Publisher;
pub(crate) use rebuild_lock::RebuildLock;
pub(crate) use record::{offset_above, read_all, NewRecord, Records, StreamRecord};
