//! What operators see and run: the admin endpoints ([`admin`]), slot health for metrics
//! ([`monitor`]), and the commands: `setup`, `slots`, `streams`, `check`, `drop-slot`,
//! `reshard`, `functions`.

pub(crate) mod admin;
mod functions;
pub(crate) mod monitor;
mod reshard;
mod setup;
mod slots;
pub(crate) mod streams;

pub use functions::{functions, libraries};
pub use reshard::reshard;
#[cfg(any(test, feature = "test-support"))]
pub use setup::{init_stream_record, RecordOutcome};
pub use setup::{setup, setup_command, SetupOutcome};
pub use slots::{check, drop_slot, slots, CheckStatus};
pub use streams::streams;
