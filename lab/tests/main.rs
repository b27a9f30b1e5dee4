//! The lab's tests, one binary: the experiments as CI runs them, and one message's trace
//! across the four processes, with the real binaries.

use std::path::PathBuf;

use lab::system::Bins;

mod experiments;
mod traces;

/// The debug builds of the binaries the experiments run, built now if they are stale.
fn bins() -> Bins {
    Bins::built_for_tests(
        PathBuf::from(env!("CARGO_BIN_EXE_chat-lab")),
        env!("CARGO_MANIFEST_DIR"),
    )
}
