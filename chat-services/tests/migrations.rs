//! Migrations of several databases of one fresh cluster at once (what a test run or a
//! cluster hosting several deployments does): roles are cluster-wide, so the runs meet.

use testkit::PgServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn databases_of_one_fresh_cluster_migrate_at_once() {
    // Before: about one run in two failed with `role "consumers_owner" does not exist` (V19).
    for _ in 0..3 {
        let pg = PgServer::start().unwrap();
        let runs = (0..6).map(|_| pg.create_database());
        for result in futures::future::join_all(runs).await {
            result.expect("every database migrated");
        }
    }
}
