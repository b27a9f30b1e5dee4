//! What the build pulls in: every package in `Cargo.lock` is the workspace's own or comes
//! from crates.io (no git repositories, no other registries), the `sources` half of what
//! `cargo deny` checks. (Its `advisories` half needs the RustSec database, which is fetched
//! from GitHub: not reachable from this CI; run `cargo deny check advisories` where it is.)

use repo_checks::read;

const CRATES_IO: &str = "registry+https://github.com/rust-lang/crates.io-index";

#[test]
fn every_dependency_comes_from_crates_io() {
    let lock = read("Cargo.lock");
    let mut foreign = Vec::new();
    let mut packages = 0;
    for package in lock.split("[[package]]").skip(1) {
        packages += 1;
        let field = |name: &str| {
            package.lines().find_map(|line| {
                line.strip_prefix(name)
                    .and_then(|rest| rest.trim().strip_prefix('='))
                    .map(|v| v.trim().trim_matches('"').to_string())
            })
        };
        let name = field("name ").unwrap_or_default();
        // No source: a member of this workspace.
        if let Some(source) = field("source ").filter(|s| s != CRATES_IO) {
            foreign.push(format!("{name}: {source}"));
        }
    }
    assert!(packages > 100, "Cargo.lock read as {packages} packages");
    assert!(
        foreign.is_empty(),
        "packages from elsewhere than crates.io (pin a published release instead):\n{}",
        foreign.join("\n")
    );
}
