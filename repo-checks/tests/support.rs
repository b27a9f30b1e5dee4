//! What the checks share: a chat service running in-process on a database and Redis of its
//! own (to ask it for the routes the deploy files probe), and the HTTP calls of a user.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use testkit::{PgServer, RedisServer, TestDb};
use tokio_util::sync::CancellationToken;

/// A Consumers service in-process, anonymous, on a migrated database and a Redis of its own;
/// stopped when dropped.
pub(crate) struct RunningService {
    pub addr: SocketAddr,
    /// /healthz, /readyz, /metrics.
    pub admin: SocketAddr,
    shutdown: CancellationToken,
    _db: TestDb,
    _redis: RedisServer,
}

impl RunningService {
    pub(crate) async fn start(pg: &PgServer) -> Self {
        let db = pg.create_database().await.expect("test database");
        let redis = RedisServer::start().expect("redis");
        let side = chat_services::Side::Consumers;
        let argv = [
            "chat-service".to_string(),
            "--side".into(),
            side.as_str().into(),
            "--database-url".into(),
            db.url(side.as_str()),
            "--redis-url".into(),
            redis.url(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--admin-addr".into(),
            "127.0.0.1:0".into(),
            "--allow-anonymous=true".into(),
        ];
        let config = chat_services::Cli::try_parse_from(argv)
            .expect("service flags")
            .validate()
            .expect("valid");
        let shutdown = CancellationToken::new();
        let service = chat_services::Service::bind(config, shutdown.clone())
            .await
            .expect("bind");
        let addr = service.local_addr();
        let admin = service.admin_addr().expect("admin listener");
        tokio::spawn(service.run());
        Self {
            addr,
            admin,
            shutdown,
            _db: db,
            _redis: redis,
        }
    }
}

impl Drop for RunningService {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// `Authorization: Bearer <token>`.
pub(crate) fn bearer(token: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {token}"))
}

/// Send `body` to chat `chat_id` as the holder of `token`; the reply.
pub(crate) async fn send_as(
    addr: SocketAddr,
    token: &str,
    chat_id: i64,
    body: &str,
) -> testkit::http::Reply {
    let (name, value) = bearer(token);
    testkit::http::post_json(
        addr,
        &format!("/chats/{chat_id}/messages"),
        &serde_json::json!({"body": body}),
        &[(name, &value)],
    )
    .await
    .unwrap()
}

/// The next `message` event's data as JSON, or a panic after `timeout`.
pub(crate) async fn next_message(
    client: &mut testkit::http::SseClient,
    timeout: Duration,
) -> (String, serde_json::Value) {
    let event = client.next(timeout).await.expect("an SSE message in time");
    assert_eq!(event.event, "message");
    (
        event.id.expect("SSE id"),
        serde_json::from_str(&event.data).expect("JSON data"),
    )
}
