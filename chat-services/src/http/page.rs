//! `GET /`, `/page.js`, `/page.css`: the chat page and its files, under a strict policy.

use super::reply::{self, Body};
use super::App;
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::Response;

pub(super) const PAGE: &str = include_str!("../page.html");
pub(super) const PAGE_JS: &str = include_str!("../page.js");
pub(super) const PAGE_CSS: &str = include_str!("../page.css");

/// The page's policy: its script and style are files of this origin (no inline code, so an
/// injected `<script>` never runs), nothing may frame it, forms post only here.
pub(super) const PAGE_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub(super) fn page(app: &App) -> Response<Body> {
    let html = PAGE
        .replace("{{SIDE}}", app.side.as_str())
        .replace("{{OTHER}}", app.side.other().as_str());
    asset(html, "text/html; charset=utf-8")
}

/// `GET /page.js` and `GET /page.css`.
pub(super) fn page_file(name: &str) -> Response<Body> {
    match name {
        "page.js" => asset(PAGE_JS.to_string(), "text/javascript; charset=utf-8"),
        _ => asset(PAGE_CSS.to_string(), "text/css; charset=utf-8"),
    }
}

pub(super) fn asset(content: String, mime: &'static str) -> Response<Body> {
    let mut resp = Response::new(reply::full(content));
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(mime));
    headers.insert(
        "content-security-policy",
        HeaderValue::from_static(PAGE_POLICY),
    );
    headers.insert("x-frame-options", HeaderValue::from_static("DENY"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}
