//! The services' named Valkey subset: a poison entry dead-lettered while others flow, the
//! lease fence refusing a stale writer, and a consumer killed between its inbox commit and
//! its acknowledgement, run again by this very test binary against Valkey 8.1
//! (`deploy/install-deps.sh` installs it).

const SUBSET: [&str; 3] = [
    "delivery::a_poison_entry_is_dead_lettered_and_messages_after_it_flow",
    "fence::a_stale_writer_is_refused_and_a_claim_waits_for_its_write",
    "crash::killed_after_inbox_commit_before_xack_the_message_is_redelivered_skipped_and_shown_once",
];

#[test]
fn the_named_subset_passes_on_valkey() {
    if std::env::var_os(testkit::REDIS_SERVER_ENV).is_some() {
        // Already the child run (or a whole suite pointed at another server): nothing more.
        return;
    }
    let (passed, output) = testkit::run_on_valkey(&SUBSET).expect("run the subset on Valkey");
    assert!(passed, "the named subset failed on Valkey:\n{output}");
}
