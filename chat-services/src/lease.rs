//! The inbox consumer's lease: one active consumer per receiving side, so messages are
//! recorded (and shown) in the stream's order, which is the sender's commit order. The
//! relay's rebuild lock is the same lease; one implementation serves both.

pub use cdc_relay::lease::Lease;
