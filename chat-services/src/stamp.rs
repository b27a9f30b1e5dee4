//! What tells one version of a file from another, for the files read again when they change
//! (the JWKS, the TLS certificate): a rename or a symlink swap (as Kubernetes updates a
//! mounted ConfigMap or Secret) changes the inode, an in-place write the size or the change
//! time, even within one tick of the modification time.

use std::path::Path;
use std::time::SystemTime;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    inode: u64,
    len: u64,
    modified: Option<SystemTime>,
    changed: (i64, i64),
}

impl Stamp {
    /// The file's stamp now; `None` if it cannot be looked at.
    pub(crate) fn of(path: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(Self {
            inode: m.ino(),
            len: m.len(),
            modified: m.modified().ok(),
            changed: (m.ctime(), m.ctime_nsec()),
        })
    }
}
