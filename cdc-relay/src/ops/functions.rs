//! `cdc-relay functions`: load the relay's Redis functions (`outbox_core::functions`) as
//! Redis's admin, once per Redis and again after it lost its data, or print them for
//! `redis-cli FUNCTION LOAD`. The relay's own user may only call them.

use std::time::Duration;

use outbox_core::functions::Library;

use crate::cli::FunctionsArgs;
use crate::error::RelayError;

const TIMEOUT: Duration = Duration::from_secs(10);

/// The function libraries the relay calls: its own and the lease's (its rebuild lock).
pub fn libraries() -> [&'static Library; 2] {
    [
        &outbox_core::lease::LIBRARY,
        &crate::sink::functions::LIBRARY,
    ]
}

/// How long the loader waits for a Redis that is not up yet (or loading its data).
const PATIENCE: Duration = Duration::from_secs(120);

/// Load every library (on every primary of a cluster), or with `--print-dir` write each to
/// a file there instead (one per `redis-cli FUNCTION LOAD`); what was done, a line each.
pub async fn functions(args: &FunctionsArgs) -> Result<String, RelayError> {
    let mut out = String::new();
    if let Some(dir) = &args.print_dir {
        for library in libraries() {
            let path = dir.join(format!("{}.lua", library.name()));
            std::fs::write(&path, library.code()).map_err(|e| {
                RelayError::Config(format!("--print-dir: cannot write {}: {e}", path.display()))
            })?;
            out.push_str(&format!("wrote {}\n", path.display()));
        }
        return Ok(out);
    }
    let redis = args.connection.redis(TIMEOUT)?;
    for name in outbox_core::functions::load_all(&redis, &libraries(), PATIENCE).await? {
        out.push_str(&format!("loaded {name}\n"));
    }
    Ok(out)
}
