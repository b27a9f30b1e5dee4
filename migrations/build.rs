//! Rebuild the crate when a migration file is added or changed: `embed_migrations!` reads
//! the `sql/` directory at compile time, and cargo does not track it otherwise.

fn main() {
    println!("cargo:rerun-if-changed=sql");
}
