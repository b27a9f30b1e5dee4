//! `GET /chats/{id}/events`: admitting a client to the chat's live feed (the stream itself
//! is `sse`).

use super::reply::{self, Body};
use super::request::*;
use super::{sse, App};
use crate::access::budgets::Kind;
use crate::model::{self};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use std::sync::Arc;
use std::time::Duration;

/// `GET /chats/{id}/events`.
pub(super) async fn events(
    app: Arc<App>,
    chat_id: &str,
    req: &Request<Incoming>,
) -> Response<Body> {
    let chat_id = match model::parse_chat_id(chat_id) {
        Ok(id) => id,
        Err(e) => return input_error(e),
    };
    let who = match admit(&app, req.headers(), chat_id, Kind::StreamOpen).await {
        Ok(admitted) => admitted.who,
        Err(resp) => return resp,
    };
    let entitlement = match who {
        None => None,
        Some(who) => {
            let Some(slot) = app.limits.quotas.open_stream(&who.user) else {
                return too_many(
                    &app,
                    "streams_per_user",
                    Duration::from_secs(1),
                    format!(
                    "{} has {} event streams open on this instance, the most allowed; close one",
                    who.user, app.limits.quotas.max_streams()
                ),
                );
            };
            let (Some(verifier), Some(credential)) =
                (app.auth.verifier(), app.auth.credential(req.headers()))
            else {
                unreachable!("an identified caller came with a credential")
            };
            Some(sse::Entitlement {
                watch: app.streams.watch(chat_id, &who.user),
                expires_in: who.remaining(),
                recheck: sse::Recheck {
                    changes: verifier.changes(),
                    verifier,
                    credential: credential.to_owned(),
                },
                _slot: slot,
            })
        }
    };
    let bad_position = |name: &str, raw: &str| {
        reply::error(
            StatusCode::BAD_REQUEST,
            format!("{name} must be an event id like p42 (a feed position), got '{raw}'"),
        )
    };
    // Last-Event-ID (sent by a reconnecting EventSource) wins over the URL's ?after=.
    let after = if let Some(header) = req.headers().get("last-event-id") {
        let raw = header.to_str().unwrap_or_default();
        match sse::Cursor::parse(raw) {
            Some(cursor) => Some(cursor),
            None => return bad_position("Last-Event-ID", raw),
        }
    } else {
        let mut after = None;
        for (key, value) in query_pairs(req.uri().query()) {
            if key != "after" {
                return reply::error(
                    StatusCode::BAD_REQUEST,
                    format!("unknown query parameter '{key}'; use after"),
                );
            }
            match sse::Cursor::parse(&value) {
                Some(cursor) => after = Some(cursor),
                None => return bad_position("after", &value),
            }
        }
        after
    };
    let start = match sse::clamp(&app, chat_id, after).await {
        Ok(start) => start,
        Err(e) => return store_error(e),
    };
    sse::respond(app, chat_id, start, entitlement)
}
