//! The relay's Redis functions (`outbox_core::functions`): publishing, making room for a
//! catch-up, and writing the stream's record. Its Redis user calls them with `FCALL` and
//! can run no script of its own. Only `publish` grows the stream, so only it is refused
//! while Redis is out of memory; the record's few bytes and the trimming run then too
//! (`allow-oom`), so a session starts and makes room.

use std::sync::LazyLock;

use outbox_core::functions::{Body, Function, Library};

use super::publisher::{ROOM, SCRIPT};
use super::record::{ADOPT, CLAIM_EPOCH, CREATE, REPLACE};

/// Every function the relay calls.
pub(crate) static LIBRARY: LazyLock<Library> = LazyLock::new(|| {
    Library::new(
        "outbox_relay",
        &[
            Body {
                name: "publish",
                body: SCRIPT,
                flags: &[],
            },
            // Only trims: it must run when Redis is out of memory, to make room.
            Body {
                name: "room",
                body: ROOM,
                flags: &["allow-oom"],
            },
            Body {
                name: "record_create",
                body: CREATE,
                flags: &["allow-oom"],
            },
            Body {
                name: "record_replace",
                body: REPLACE,
                flags: &["allow-oom"],
            },
            Body {
                name: "claim_epoch",
                body: CLAIM_EPOCH,
                flags: &["allow-oom"],
            },
            // Answers 1: the library is there (asked before a session reads from the slot).
            Body {
                name: "ready",
                body: "return 1",
                flags: &["no-writes", "allow-oom"],
            },
            Body {
                name: "adopt_timeline",
                body: ADOPT,
                flags: &["allow-oom"],
            },
        ],
    )
});

pub(crate) static PUBLISH: LazyLock<Function> = LazyLock::new(|| LIBRARY.function("publish"));
pub(crate) static MAKE_ROOM: LazyLock<Function> = LazyLock::new(|| LIBRARY.function("room"));
pub(crate) static RECORD_CREATE: LazyLock<Function> =
    LazyLock::new(|| LIBRARY.function("record_create"));
pub(crate) static RECORD_REPLACE: LazyLock<Function> =
    LazyLock::new(|| LIBRARY.function("record_replace"));
pub(crate) static CLAIM: LazyLock<Function> = LazyLock::new(|| LIBRARY.function("claim_epoch"));
pub(crate) static ADOPT_TIMELINE: LazyLock<Function> =
    LazyLock::new(|| LIBRARY.function("adopt_timeline"));
pub(crate) static READY: LazyLock<Function> = LazyLock::new(|| LIBRARY.function("ready"));
