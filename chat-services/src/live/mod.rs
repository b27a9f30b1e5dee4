//! Live delivery: what was just committed to a chat's feed, shown at once to the chat's
//! open event streams on every instance.
//!
//! - `hub`: this instance's live channels, one per chat with open streams;
//! - `hints`: the committing instance tells the others (Redis pub/sub), with the resyncs
//!   that cover a lost hint;
//! - `tips`: the safety net under both, the database's newest position of each chat.
//!
//! The database is the source of truth; nothing here is needed for correctness, only for
//! speed: a stream that misses a hint catches up from the feed.

pub(crate) mod hints;
pub(crate) mod hub;
pub(crate) mod tips;
