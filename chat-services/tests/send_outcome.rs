//! A send whose connection dies right after Postgres committed it: the service learns the
//! outcome instead of guessing, answers 201 with the message, and nothing is written twice.

use crate::support::Stack;
use chat_services::Side;
use testkit::proxy::Proxy;
use testkit::PgServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_after_commit_answers_the_message_once() {
    // GIVEN the Consumers service reaching Postgres through a proxy that can cut a
    // connection right after the server answered
    let pg = PgServer::start().unwrap();
    let stack = Stack::start(&pg).await;
    let proxy = Proxy::to_unix(pg.socket_dir().join(".s.PGSQL.5432"))
        .await
        .unwrap();
    let mut args = stack.service_args(Side::Consumers, &[]);
    let url = args.iter().position(|a| a == "--database-url").unwrap() + 1;
    args[url] = format!(
        "postgres://consumers@{}/{}?sslmode=disable",
        proxy.addr(),
        stack.db.name
    );
    let consumers = stack.service_with(args).await;
    let ok = crate::support::send(consumers.addr, 4, "before the cut").await;
    assert_eq!(ok["body"], "before the cut");

    // WHEN the connection carrying a send is cut right after Postgres committed it
    proxy.cut_reply_after(b"cut right after commit");
    let reply = testkit::http::post_json(
        consumers.addr,
        "/chats/4/messages",
        &serde_json::json!({"body": "cut right after commit"}),
        &[],
    )
    .await
    .unwrap();

    // THEN the client gets 201 with the message, which is written exactly once
    assert!(proxy.cut_done(), "the proxy never cut the connection");
    assert_eq!(reply.status, 201, "{}", reply.body);
    let message = reply.json();
    assert_eq!(message["body"], "cut right after commit");
    assert_eq!(
        stack
            .count("SELECT count(*) FROM consumers.messages WHERE body = 'cut right after commit'")
            .await,
        1
    );
    assert_eq!(
        stack
            .count("SELECT count(*) FROM consumers.outbox WHERE payload->>'body' = 'cut right after commit'")
            .await,
        1
    );
    let id: String = stack
        .db
        .connect()
        .await
        .unwrap()
        .query_one(
            "SELECT id::text FROM consumers.messages WHERE body = 'cut right after commit'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(message["id"], id.as_str());
    consumers.stop().await;
    stack.stop().await;
}
