//! The relay's named Valkey subset: the tests that cover publishing, the rejection of a
//! replay, group-aware trimming, the writer fence, a rebuild, a mapped and a routed outbox and
//! tableless events kept through a wipe, run again by this very test binary against a Valkey
//! 8.1 server (`deploy/install-deps.sh` installs it). Valkey reports `redis_version:7.2.4` and
//! lacks Redis 8's stream commands, so the relay must take the paths it takes on Redis 7.

/// The subset, by exact test name.
const SUBSET: [&str; 9] = [
    "stream::committed_inserts_arrive_exactly_once_in_commit_order",
    "faults::sigkill_mid_stream_loses_and_duplicates_nothing",
    "recovery::trimming_never_deletes_what_a_group_has_not_acknowledged",
    "recovery::a_relay_cut_off_mid_publish_writes_nothing_after_another_took_over_and_rebuilt",
    "recovery::redis_emptied_while_the_relay_is_quiet_gets_every_row_back",
    "shards::every_chat_lands_in_its_shard_in_commit_order",
    "mapping::a_debezium_outbox_is_relayed_once_in_key_order_through_kill_restart_and_wipe",
    "mapping::a_debezium_outbox_routed_by_aggregate_type_is_relayed_once_per_stream_through_kill_restart_and_wipe",
    "messages::messages_written_while_redis_loses_its_data_are_published_once_beside_the_rebuilt_rows",
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
