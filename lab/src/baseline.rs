//! The designs the write-up compared, rebuilt so they run beside ours on the same machine:
//!
//! - `sender --mode dual-write`: the first version. A send commits the message, then hands
//!   the event to an in-memory queue that XADDs it whenever Redis is reachable. What the queue
//!   holds when the process stops is gone.
//! - `sender --mode notify`: the second version's write side: message, outbox row and
//!   `NOTIFY` in one transaction.
//! - `relay --mode notify|poll`: the second version's relay: `SELECT ... FOR UPDATE` batches of
//!   100 unsent outbox rows, XADD them, mark them sent, commit; woken by `NOTIFY` (or only by a
//!   1 s timer in `poll` mode).
//!
//! They write the same stream entry fields as cdc-relay, so the real receiving service
//! consumes them unchanged. They are lab code: no configuration validation beyond clap.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use chat_services::Side;
use chat_services::{parse_chat_id, parse_send_request, Message, MESSAGE_CREATED};
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tracing::{info, warn};
use uuid::Uuid;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// A sending service of an earlier design.
    Sender(SenderArgs),
    /// The polling/NOTIFY relay of the second design.
    Relay(RelayArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum SenderMode {
    DualWrite,
    Notify,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum RelayMode {
    Notify,
    Poll,
}

#[derive(Debug, clap::Args)]
pub struct SenderArgs {
    #[arg(long, value_enum)]
    pub mode: SenderMode,
    #[arg(long, value_enum)]
    pub side: Side,
    #[arg(long)]
    pub database_url: String,
    #[arg(long)]
    pub redis_url: String,
    #[arg(long)]
    pub listen: String,
}

#[derive(Debug, clap::Args)]
pub struct RelayArgs {
    #[arg(long, value_enum)]
    pub mode: RelayMode,
    #[arg(long, value_enum)]
    pub side: Side,
    #[arg(long)]
    pub database_url: String,
    #[arg(long)]
    pub redis_url: String,
}

/// The column the second design marks sent rows with (ours needs none).
pub const SENT_AT_DDL: &str = "ALTER TABLE {s}.outbox ADD COLUMN IF NOT EXISTS sent_at timestamptz;
     CREATE INDEX IF NOT EXISTS outbox_unsent ON {s}.outbox (id) WHERE sent_at IS NULL;";

pub async fn run(command: Command) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    match command {
        Command::Sender(args) => sender(args).await,
        Command::Relay(args) => relay(args).await,
    }
}

async fn pg(url: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

fn stream_fields(message: &Message) -> Vec<(&'static str, String)> {
    vec![
        ("event", MESSAGE_CREATED.to_string()),
        (
            "payload",
            serde_json::to_string(message).expect("serializes"),
        ),
        ("outbox_id", "0".to_string()),
        (
            "created_at",
            message
                .created_at
                .format(&time::format_description::well_known::Rfc3339)
                .expect("formats"),
        ),
    ]
}

struct SenderState {
    mode: SenderMode,
    side: Side,
    db: tokio::sync::Mutex<tokio_postgres::Client>,
    /// Dual write: events committed to Postgres, not yet in Redis. Process memory only.
    queue: Mutex<VecDeque<Message>>,
    queued: Notify,
}

async fn sender(args: SenderArgs) -> anyhow::Result<()> {
    let state = Arc::new(SenderState {
        mode: args.mode,
        side: args.side,
        db: tokio::sync::Mutex::new(pg(&args.database_url).await?),
        queue: Mutex::new(VecDeque::new()),
        queued: Notify::new(),
    });
    if args.mode == SenderMode::DualWrite {
        let client = redis::Client::open(args.redis_url.as_str())?;
        tokio::spawn(drain_queue(state.clone(), client));
    }
    let listener = TcpListener::bind(&args.listen).await?;
    info!(mode = ?args.mode, side = %args.side, listen = %args.listen, "baseline sender listening");
    // Like the original's Node process: SIGTERM ends it at once, whatever the queue holds.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let (stream, _) = tokio::select! {
            _ = term.recv() => {
                let pending = state.queue.lock().unwrap().len();
                warn!(pending, "stopping; queued events are dropped");
                return Ok(());
            }
            accepted = listener.accept() => accepted?,
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(handle(&state, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn reply(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        "content-type",
        "application/json".parse().expect("valid header"),
    );
    resp
}

async fn handle(state: &SenderState, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    if path == "/readyz" || path == "/healthz" {
        return reply(
            StatusCode::OK,
            r#"{"status":"ready","consumer":"none"}"#.into(),
        );
    }
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let chat_id = match segments.as_slice() {
        ["chats", id, "messages"] if req.method() == hyper::Method::POST => match parse_chat_id(id)
        {
            Ok(id) => id,
            Err(e) => {
                return reply(
                    StatusCode::BAD_REQUEST,
                    serde_json::json!({"error": e.to_string()}).to_string(),
                )
            }
        },
        _ => return reply(StatusCode::NOT_FOUND, r#"{"error":"not found"}"#.into()),
    };
    let Ok(raw) = req.into_body().collect().await.map(|b| b.to_bytes()) else {
        return reply(
            StatusCode::BAD_REQUEST,
            r#"{"error":"unreadable body"}"#.into(),
        );
    };
    let body = match parse_send_request(&raw) {
        Ok(body) => body,
        Err(e) => {
            return reply(
                StatusCode::BAD_REQUEST,
                serde_json::json!({"error": e.to_string()}).to_string(),
            )
        }
    };
    let now = time::OffsetDateTime::now_utc();
    let message = Message {
        id: Uuid::now_v7(),
        chat_id,
        body,
        created_at: now
            .replace_nanosecond(now.nanosecond() / 1000 * 1000)
            .expect("valid"),
        side: state.side,
        sender: None,
    };
    let s = state.side.schema();
    let result = {
        let mut db = state.db.lock().await;
        match state.mode {
            SenderMode::DualWrite => db
                .execute(
                    &format!("INSERT INTO {s}.messages (id, chat_id, body, created_at) VALUES ($1, $2, $3, $4)"),
                    &[&message.id, &message.chat_id, &message.body, &message.created_at],
                )
                .await
                .map(|_| ()),
            SenderMode::Notify => {
                let payload = serde_json::to_value(&message).expect("serializes");
                async {
                    let tx = db.transaction().await?;
                    tx.execute(
                        &format!("INSERT INTO {s}.messages (id, chat_id, body, created_at) VALUES ($1, $2, $3, $4)"),
                        &[&message.id, &message.chat_id, &message.body, &message.created_at],
                    )
                    .await?;
                    tx.execute(
                        &format!("INSERT INTO {s}.outbox (event, payload, created_at) VALUES ($1, $2, $3)"),
                        &[&MESSAGE_CREATED, &payload, &message.created_at],
                    )
                    .await?;
                    tx.batch_execute(&format!("NOTIFY {s}_outbox")).await?;
                    tx.commit().await
                }
                .await
            }
        }
    };
    if let Err(e) = result {
        return reply(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"error": e.to_string()}).to_string(),
        );
    }
    if state.mode == SenderMode::DualWrite {
        state.queue.lock().unwrap().push_back(message.clone());
        state.queued.notify_one();
    }
    reply(
        StatusCode::CREATED,
        serde_json::to_string(&message).expect("serializes"),
    )
}

/// Dual write's second half: XADD queued events while Redis answers, retrying otherwise.
async fn drain_queue(state: Arc<SenderState>, client: redis::Client) {
    let stream = state.side.outbox_stream();
    let mut conn = None;
    loop {
        let next = state.queue.lock().unwrap().front().cloned();
        let Some(message) = next else {
            state.queued.notified().await;
            continue;
        };
        if conn.is_none() {
            conn = client.get_multiplexed_async_connection().await.ok();
        }
        let sent = match conn.as_mut() {
            Some(c) => {
                let mut cmd = redis::cmd("XADD");
                cmd.arg(&stream).arg("*");
                for (k, v) in stream_fields(&message) {
                    cmd.arg(k).arg(v);
                }
                cmd.query_async::<String>(c).await.is_ok()
            }
            None => false,
        };
        if sent {
            state.queue.lock().unwrap().pop_front();
        } else {
            conn = None;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

async fn relay(args: RelayArgs) -> anyhow::Result<()> {
    let s = args.side.schema();
    let db = pg(&args.database_url).await?;
    db.batch_execute(&SENT_AT_DDL.replace("{s}", s)).await?;
    let wake = Arc::new(Notify::new());
    if args.mode == RelayMode::Notify {
        let (listener, mut connection) =
            tokio_postgres::connect(&args.database_url, tokio_postgres::NoTls).await?;
        let wake = wake.clone();
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(Ok(message)) = messages.next().await {
                if let tokio_postgres::AsyncMessage::Notification(_) = message {
                    wake.notify_one();
                }
            }
        });
        listener
            .batch_execute(&format!("LISTEN {s}_outbox"))
            .await?;
        std::mem::forget(listener);
    }
    let redis = redis::Client::open(args.redis_url.as_str())?;
    let mut conn = None;
    let mut db = db;
    info!(mode = ?args.mode, side = %args.side, "baseline relay running");
    loop {
        loop {
            if conn.is_none() {
                conn = redis.get_multiplexed_async_connection().await.ok();
            }
            let Some(c) = conn.as_mut() else { break };
            match relay_batch(&mut db, c, s, &args.side.outbox_stream()).await {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    warn!(error = %e, "relay batch failed; rows stay unsent");
                    conn = None;
                    break;
                }
            }
        }
        // Woken by NOTIFY, or after a second at the latest.
        let _ = tokio::time::timeout(Duration::from_secs(1), wake.notified()).await;
    }
}

async fn relay_batch(
    db: &mut tokio_postgres::Client,
    redis: &mut redis::aio::MultiplexedConnection,
    s: &str,
    stream: &str,
) -> anyhow::Result<usize> {
    let tx = db.transaction().await?;
    let rows = tx
        .query(
            &format!(
                "SELECT id, payload FROM {s}.outbox WHERE sent_at IS NULL ORDER BY id LIMIT 100 FOR UPDATE"
            ),
            &[],
        )
        .await?;
    if rows.is_empty() {
        tx.commit().await?;
        return Ok(0);
    }
    let mut pipe = redis::pipe();
    let mut ids: Vec<i64> = Vec::with_capacity(rows.len());
    for row in &rows {
        ids.push(row.get(0));
        let payload: serde_json::Value = row.get(1);
        let message: Message = serde_json::from_value(payload)?;
        let cmd = pipe.cmd("XADD").arg(stream).arg("*");
        for (k, v) in stream_fields(&message) {
            cmd.arg(k).arg(v);
        }
    }
    let _: Vec<String> = pipe.query_async(redis).await?;
    tx.execute(
        &format!("UPDATE {s}.outbox SET sent_at = now() WHERE id = ANY($1)"),
        &[&ids],
    )
    .await?;
    tx.commit().await?;
    Ok(rows.len())
}
