//! `GET /chats/{id}/events`: the chat's feed (sent and received messages, in the order
//! history shows them) as Server-Sent Events.
//!
//! The stream subscribes to the live hub first, then replays from the database everything
//! after the client's position (`Last-Event-ID` or `?after=`), then forwards live messages.
//! Positions are consecutive, so the stream sends a live message only if it is the next
//! one; anything further on (or a tip beyond, a resync, a lag) makes it read the gap from
//! the database first. A message can never be skipped, and none is sent twice. Each client
//! has its own bounded queue; one that falls behind is caught up from the database rather
//! than slowing anyone else.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::telemetry;

use bytes::Bytes;
use futures::stream;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::Response;
use hyper::StatusCode;
use tokio::sync::{broadcast, mpsc};
use tracing::debug;

use super::reply::Body;
use super::App;
use crate::live::hub::{frame, Delivery, Live, Subscription};
use crate::store::StoreError;

/// Where a client resumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cursor {
    /// After this feed position (event ids `p<pos>`).
    Pos(i64),
    /// After this side-wide inbox position: an event id from before migration V7 (a
    /// browser reconnecting across the upgrade).
    InboxSeq(i64),
}

impl Cursor {
    /// `p<n>`, or a bare `<n>` of the previous scheme; `None` if neither.
    pub(crate) fn parse(raw: &str) -> Option<Self> {
        let raw = raw.trim();
        let number = |s: &str| {
            (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse::<i64>().ok())
                .flatten()
        };
        match raw.strip_prefix('p') {
            Some(pos) => number(pos).map(Cursor::Pos),
            None => number(raw).map(Cursor::InboxSeq),
        }
    }
}

/// Messages replayed from the database per query.
const REPLAY_PAGE: i64 = 500;
/// Frames queued for one client before its stream waits (and its live feed may lag).
const CLIENT_QUEUE: usize = 64;

/// What ends a user's stream besides the client: leaving the chat, the token expiring, or
/// its key withdrawn (the page then signs in again and resumes with `Last-Event-ID`).
pub(crate) struct Entitlement {
    pub watch: crate::access::streams::Watch,
    pub expires_in: std::time::Duration,
    /// The credential the stream was opened with, verified again whenever the key set
    /// changes: a key withdrawn ends the streams it signed.
    pub recheck: Recheck,
    /// The user's place among their open streams, held as long as the stream.
    pub _slot: crate::access::quota::StreamSlot,
}

/// A stream's credential and the verifier's key-set changes.
pub(crate) struct Recheck {
    pub verifier: Arc<crate::access::auth::Verifier>,
    pub credential: crate::access::auth::OwnedCredential,
    pub changes: tokio::sync::watch::Receiver<u64>,
}

impl Recheck {
    /// Returns once the token no longer verifies; checked at once (the set may have changed
    /// between the request's check and the subscription to changes: a remembered token
    /// costs a lookup) and after every change of the key set.
    async fn until_refused(mut self) {
        loop {
            if self.verifier.check(self.credential.borrow()).is_err() {
                return;
            }
            if self.changes.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

/// Where a stream starts, and what it leaves out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Start {
    pub after: Option<Cursor>,
    /// The client asked to resume from further back than `--sse-max-replay`: positions
    /// after `.0` up to `.1` are not replayed (the client pages history for them).
    pub skipped: Option<(i64, i64)>,
}

/// A cursor past the feed's tip names positions the database does not have (it was
/// restored from a backup since): the client resumes from the tip, or it would be shown
/// nothing new until some future position passed its cursor. No cursor ("from now on")
/// is the tip. A cursor more than `--sse-max-replay` behind the tip starts that far behind
/// it instead, and the stream says what it skipped: one open costs a bounded replay,
/// however long the chat. The tip is read before the stream subscribes to live messages
/// and before the client has its answer: read after, a message committed in between (one
/// the client sent on getting its answer) would sit at or below it and be taken for one the
/// client had, and never shown (seen in CI, under load).
pub(crate) async fn clamp(
    app: &App,
    chat_id: i64,
    after: Option<Cursor>,
) -> Result<Start, StoreError> {
    let tip = || async {
        let tips = app.store.tips(&[chat_id]).await?;
        Ok::<_, StoreError>(tips.first().map_or(0, |(_, tip)| *tip))
    };
    let unclamped = |after| Start {
        after,
        skipped: None,
    };
    // A cursor of the previous scheme is resolved to its position first, so it is held to
    // the same replay depth (a bare `0` would otherwise replay the whole chat).
    let after = match after {
        Some(Cursor::InboxSeq(seq)) => Some(Cursor::Pos(
            app.store.position_of_inbox_seq(chat_id, seq).await?,
        )),
        other => other,
    };
    match after {
        Some(Cursor::Pos(pos)) => {
            let tip = tip().await?;
            let pos = pos.min(tip);
            let deepest = tip.saturating_sub(app.sse_max_replay);
            Ok(if pos < deepest {
                Start {
                    after: Some(Cursor::Pos(deepest)),
                    skipped: Some((pos, deepest)),
                }
            } else {
                unclamped(Some(Cursor::Pos(pos)))
            })
        }
        _ => Ok(unclamped(Some(Cursor::Pos(tip().await?)))),
    }
}

/// What a stream that starts behind `--sse-max-replay` says first: the positions after
/// `from` up to `to` are not replayed. Its id is `to`, so a reconnect resumes from there.
fn skipped_frame(from: i64, to: i64) -> Bytes {
    Bytes::from(format!(
        "id: p{to}\nevent: skipped\ndata: {{\"after\":\"p{from}\",\"until\":\"p{to}\"}}\n\n"
    ))
}

/// Start streaming chat `chat_id` after `after` (`None`: from now on), for as long as
/// `entitlement` (if any) holds.
pub(crate) fn respond(
    app: Arc<App>,
    chat_id: i64,
    start: Start,
    entitlement: Option<Entitlement>,
) -> Response<Body> {
    let Ok(permit) = app.limits.event_streams.clone().try_acquire_owned() else {
        app.metrics.event_streams_refused_total.inc();
        let mut resp = super::reply::error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many event streams on this instance; retry in a moment",
        );
        resp.headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
        return resp;
    };
    let (tx, rx) = mpsc::channel::<Bytes>(CLIENT_QUEUE);
    let queued = Arc::new(AtomicUsize::new(0));
    let app_queued = app.limits.sse_queued.clone();
    let client = Client {
        tx,
        queued: queued.clone(),
    };
    let live = app.hub.subscribe(chat_id);
    tokio::spawn(async move {
        app.metrics.sse_clients.inc();
        let streamed = stream_events(&app, chat_id, start, live, &client);
        let ended = match entitlement {
            None => streamed.await,
            Some(entitlement) => tokio::select! {
                ended = streamed => ended,
                _ = entitlement.watch.revoked.cancelled() => Err(StreamEnd::Revoked),
                _ = tokio::time::sleep(entitlement.expires_in) => {
                    app.metrics.event_streams_revoked_total.inc();
                    Err(StreamEnd::Expired)
                },
                _ = entitlement.recheck.until_refused() => {
                    app.metrics.event_streams_revoked_total.inc();
                    Err(StreamEnd::KeyWithdrawn)
                }
            },
        };
        if let Err(e) = ended {
            debug!(chat_id, error = %e, "event stream ended");
        }
        app.metrics.sse_clients.dec();
        drop(permit);
    });
    let total = app_queued;
    let body = stream::unfold(Unqueue { rx, queued, total }, |mut q| async move {
        let bytes = q.rx.recv().await?;
        q.taken(bytes.len());
        Some((Ok(Frame::data(bytes)), q))
    });
    let mut resp = Response::new(StreamBody::new(body).boxed());
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

/// The reading end of a client's queue: what the connection takes leaves both counts; what
/// is still queued when the stream goes (a client gone mid-backlog) leaves the instance's
/// count then.
struct Unqueue {
    rx: mpsc::Receiver<Bytes>,
    queued: Arc<AtomicUsize>,
    total: Arc<AtomicUsize>,
}

impl Unqueue {
    fn taken(&mut self, len: usize) {
        self.queued.fetch_sub(len, Ordering::SeqCst);
        self.total.fetch_sub(len, Ordering::SeqCst);
    }
}

impl Drop for Unqueue {
    fn drop(&mut self) {
        // Frames left in the queue (the connection closed) are counted off with it, each
        // once: closed first, so a send waiting for room fails and counts its own frame
        // off (`send_or_give_up`), and none lands after the drain.
        self.rx.close();
        while let Ok(bytes) = self.rx.try_recv() {
            self.taken(bytes.len());
        }
    }
}

/// One client's queue of frames, and the bytes in it not yet taken by the connection.
struct Client {
    tx: mpsc::Sender<Bytes>,
    queued: Arc<AtomicUsize>,
}

#[derive(Debug, thiserror::Error)]
enum StreamEnd {
    #[error("client gone")]
    ClientGone,
    #[error("client too slow: its queue passed --sse-client-buffer")]
    TooSlow,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the user is no longer a member of the chat")]
    Revoked,
    #[error("the user's token expired")]
    Expired,
    #[error("the user's token no longer verifies against the key set (its key withdrawn)")]
    KeyWithdrawn,
}

async fn stream_events(
    app: &App,
    chat_id: i64,
    start: Start,
    live: Subscription,
    client: &Client,
) -> Result<(), StreamEnd> {
    let send = |bytes: Bytes| async move { send_or_give_up(app, client, bytes).await };
    // An event the browser sees (a comment it does not): the page takes a stream silent for
    // one and a half of them (and half a second) for dead, and opens another.
    let beat = Bytes::from(format!(
        "event: heartbeat\ndata: {{\"every_ms\":{}}}\n\n",
        app.sse_heartbeat.as_millis()
    ));
    // One at once, so the page hears from a stream whose catch-up waits (a busy database).
    send(Bytes::from_static(b"retry: 1000\n\n")).await?;
    send(beat.clone()).await?;
    if let Some((from, to)) = start.skipped {
        send(skipped_frame(from, to)).await?;
    }
    // Beats go on beside the work, which may wait for the database (a catch-up queued for
    // a read permit): the page must not take a slow stream for a dead one and open another
    // that waits the same way. A client gone ends the stream wherever it waits.
    let beats = async {
        let mut heartbeat = tokio::time::interval_at(
            tokio::time::Instant::now() + app.sse_heartbeat,
            app.sse_heartbeat,
        );
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            heartbeat.tick().await;
            send(beat.clone()).await?;
        }
    };
    tokio::select! {
        ended = feed_and_live(app, chat_id, start.after, live, client) => ended,
        ended = beats => ended,
        _ = client.tx.closed() => Err(StreamEnd::ClientGone),
        _ = app.shutdown.cancelled() => Ok(()),
    }
}

/// The feed after `after`, then live messages (and the catch-ups their gaps call for).
async fn feed_and_live(
    app: &App,
    chat_id: i64,
    after: Option<Cursor>,
    mut live: Subscription,
    client: &Client,
) -> Result<(), StreamEnd> {
    let send = |bytes: Bytes| async move { send_or_give_up(app, client, bytes).await };
    // `last`: the position of the last message sent; every one before it was sent too.
    let tip = || async {
        let tips = app.store.tips(&[chat_id]).await?;
        Ok::<_, StreamEnd>(tips.first().map_or(0, |(_, pos)| *pos))
    };
    let mut last = match after {
        // Clamped to the feed's tip before this stream subscribed (see `clamp`).
        Some(Cursor::Pos(pos)) => pos,
        Some(Cursor::InboxSeq(seq)) => app.store.position_of_inbox_seq(chat_id, seq).await?,
        None => tip().await?,
    };
    if after.is_some() {
        catch_up(app, chat_id, &mut last, client).await?;
    }
    loop {
        match live.recv().await {
            Ok(Live::Message {
                pos,
                frame,
                delivery,
            }) => {
                if pos == last + 1 {
                    let span = delivery.as_deref().and_then(push_span);
                    send(frame).await?;
                    drop(span);
                    if let Some(delivery) = delivery {
                        app.metrics
                            .recorded_to_pushed_seconds
                            .observe(seconds_since_micros(delivery.recorded_at_micros));
                    }
                    last = pos;
                } else if pos > last {
                    // A message between was announced elsewhere, late, or never.
                    app.metrics.sse_gaps_filled_total.inc();
                    catch_up(app, chat_id, &mut last, client).await?;
                }
            }
            Ok(Live::Tip(pos)) => {
                if pos > last {
                    app.metrics.sse_gaps_filled_total.inc();
                    catch_up(app, chat_id, &mut last, client).await?;
                    // Everything up to a tip is final and was just read: what is not
                    // there is a hole (see migration V7), not a message to wait for.
                    last = last.max(pos);
                }
            }
            Ok(Live::Resync) | Err(broadcast::error::RecvError::Lagged(_)) => {
                catch_up(app, chat_id, &mut last, client).await?;
            }
            Err(broadcast::error::RecvError::Closed) => return Ok(()),
        }
    }
}

/// The live push of a received message to one stream: a child of its inbox write's span
/// (ended when dropped, once the frame is queued for the client).
fn push_span(delivery: &Delivery) -> Option<telemetry::Span> {
    use telemetry::{Attribute, Kind};
    let parent = telemetry::parse(delivery.traceparent.as_deref()?)?;
    telemetry::start(
        "sse push",
        Kind::Producer,
        Some(&parent),
        None,
        vec![Attribute::new("messaging.operation.type", "send")],
    )
}

/// Seconds from a Unix time in microseconds to now (0 if that is in the future: clocks of
/// two instances).
fn seconds_since_micros(micros: u64) -> f64 {
    let then = std::time::UNIX_EPOCH + Duration::from_micros(micros);
    std::time::SystemTime::now()
        .duration_since(then)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Queue a frame for the client. A client whose queue holds more than its byte budget (or
/// with a backlog while every client's together pass the instance's), or that has not read
/// for --write-timeout, is dropped: it holds memory, a stream slot and its connection, and
/// it resumes with Last-Event-ID, missing nothing.
async fn send_or_give_up(app: &App, client: &Client, bytes: Bytes) -> Result<(), StreamEnd> {
    let len = bytes.len();
    // A frame always fits an empty queue, however large: only a backlog is over budget,
    // the client's own or, with every client's together, the instance's.
    let before = client.queued.fetch_add(len, Ordering::SeqCst);
    let total = app.limits.sse_queued.fetch_add(len, Ordering::SeqCst) + len;
    // Counted off again unless the frame lands in the queue (whose reader counts it off):
    // refused, failed, or this send abandoned (the stream ended while it waited for room).
    let mut pending = Pending {
        client,
        total: &app.limits.sse_queued,
        len,
    };
    let too_slow = || {
        app.metrics.sse_slow_clients_dropped_total.inc();
        Err(StreamEnd::TooSlow)
    };
    if before > 0
        && (before + len > app.limits.sse_client_buffer || total > app.limits.sse_buffer_total)
    {
        return too_slow();
    }
    match tokio::time::timeout(app.limits.write_timeout, client.tx.send(bytes)).await {
        Ok(Ok(())) => {
            pending.len = 0;
            Ok(())
        }
        Ok(Err(_)) => Err(StreamEnd::ClientGone),
        Err(_) => too_slow(),
    }
}

/// A frame's bytes counted as queued before it is: counted off when dropped, unless it
/// landed in the queue (`len` 0).
struct Pending<'a> {
    client: &'a Client,
    total: &'a AtomicUsize,
    len: usize,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.len > 0 {
            self.client.queued.fetch_sub(self.len, Ordering::SeqCst);
            self.total.fetch_sub(self.len, Ordering::SeqCst);
        }
    }
}

/// Send the chat's feed after `last`, advancing it.
async fn catch_up(
    app: &App,
    chat_id: i64,
    last: &mut i64,
    client: &Client,
) -> Result<(), StreamEnd> {
    loop {
        // Bounded: a resync makes every stream of the instance catch up at once, and
        // sends need connections of the same pool.
        let page = {
            let _permit = app.limits.feed_reads.acquire().await.expect("never closed");
            app.store.feed(chat_id, *last, REPLAY_PAGE).await?
        };
        let n = page.len() as i64;
        for item in &page {
            send_or_give_up(app, client, frame(item)).await?;
            *last = item.pos;
        }
        if n < REPLAY_PAGE {
            return Ok(());
        }
    }
}
