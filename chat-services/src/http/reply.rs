//! Response helpers: JSON bodies, `{"error": ...}` errors, and the body type every route
//! returns.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};

pub(crate) type Body = BoxBody<Bytes, Infallible>;

pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed()
}

/// `bytes` as a body of frames of at most 16 KiB: hyper takes the next frame only while
/// its write buffer has room, so the body (and whatever it holds, see
/// `request::hold_until_written`) lives until all but what the socket buffers absorb (some
/// hundreds of KiB) was written. A whole body in one frame is taken at once, and dropped
/// while the client has read nothing. Best effort: memory per connection stays bounded by
/// hyper's buffer either way.
pub(crate) fn chunked(bytes: impl Into<Bytes>) -> Body {
    const FRAME: usize = 16 * 1024;
    let bytes: Bytes = bytes.into();
    let frames = (0..bytes.len())
        .step_by(FRAME)
        .map(move |at| {
            Ok::<_, Infallible>(hyper::body::Frame::data(
                bytes.slice(at..(at + FRAME).min(bytes.len())),
            ))
        })
        .collect::<Vec<_>>();
    http_body_util::StreamBody::new(futures::stream::iter(frames)).boxed()
}

pub(crate) fn json(status: StatusCode, value: &impl serde::Serialize) -> Response<Body> {
    let body = serde_json::to_vec(value).expect("response serializes");
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

pub(crate) fn error(status: StatusCode, message: impl std::fmt::Display) -> Response<Body> {
    json(status, &serde_json::json!({ "error": message.to_string() }))
}

pub(crate) fn method_not_allowed(
    method: &hyper::Method,
    path: &str,
    allow: &'static str,
) -> Response<Body> {
    let mut resp = error(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {path}; allowed: {allow}"),
    );
    resp.headers_mut()
        .insert("allow", HeaderValue::from_static(allow));
    resp
}

/// 503 with `Retry-After`: the request wrote nothing and may be retried.
pub(crate) fn unavailable(message: impl std::fmt::Display) -> Response<Body> {
    let mut resp = error(StatusCode::SERVICE_UNAVAILABLE, message);
    resp.headers_mut()
        .insert("retry-after", HeaderValue::from_static("1"));
    resp
}
