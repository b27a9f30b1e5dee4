//! The one route table of the public listener: which path is which route, the methods each
//! allows, and its template, which is at once the metric label (`route`), the path in span
//! names and `http.route`, and the spelling the docs use.
//!
//! Invariant: a template names no id or user, so a label has a bounded number of values.

/// A route of the public listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    Page,
    PageJs,
    PageCss,
    Healthz,
    /// `/readyz` and `/metrics`: the admin listener's, answered here with where to find them.
    AdminOnly,
    Session,
    Messages,
    Events,
    Members,
    Member,
}

/// A path matched to its route, with the parts its template names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Matched<'a> {
    pub(crate) route: Route,
    /// The chat (`{id}`), as the client wrote it; empty for routes without one.
    pub(crate) id: &'a str,
    /// The member (`{user}`), percent-encoded as the client wrote it; empty without one.
    pub(crate) user: &'a str,
}

impl Route {
    /// The route `path` names, if any.
    pub(crate) fn of(path: &str) -> Option<Matched<'_>> {
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let (route, id, user) = match segments.as_slice() {
            [""] => (Route::Page, "", ""),
            ["page.js"] => (Route::PageJs, "", ""),
            ["page.css"] => (Route::PageCss, "", ""),
            ["healthz"] => (Route::Healthz, "", ""),
            ["readyz"] | ["metrics"] => (Route::AdminOnly, "", ""),
            ["session"] => (Route::Session, "", ""),
            ["chats", id, "messages"] => (Route::Messages, *id, ""),
            ["chats", id, "events"] => (Route::Events, *id, ""),
            ["chats", id, "members"] => (Route::Members, *id, ""),
            ["chats", id, "members", user] => (Route::Member, *id, *user),
            _ => return None,
        };
        Some(Matched { route, id, user })
    }

    /// The route's template.
    pub(crate) fn template(self) -> &'static str {
        match self {
            Route::Page => "/",
            Route::PageJs => "/page.js",
            Route::PageCss => "/page.css",
            Route::Healthz => "/healthz",
            Route::AdminOnly => "/readyz",
            Route::Session => "/session",
            Route::Messages => "/chats/{id}/messages",
            Route::Events => "/chats/{id}/events",
            Route::Members => "/chats/{id}/members",
            Route::Member => "/chats/{id}/members/{user}",
        }
    }

    /// The metric label of a request to `route` (`other`: no route of this listener).
    pub(crate) fn label(route: Option<Route>) -> &'static str {
        match route {
            Some(Route::AdminOnly) | None => "other",
            Some(route) => route.template(),
        }
    }

    /// Whether answering `method` on the route verifies a credential (a request the
    /// per-address failure limiter may hold back); the page, its files, `/healthz` and
    /// signing out verify nothing.
    pub(crate) fn verifies(self, method: &hyper::Method) -> bool {
        match self {
            Route::Page | Route::PageJs | Route::PageCss | Route::Healthz | Route::AdminOnly => {
                false
            }
            Route::Session => *method != hyper::Method::DELETE,
            Route::Messages | Route::Events | Route::Members | Route::Member => true,
        }
    }

    /// The methods the route answers, as an `Allow` header says them.
    pub(crate) fn allowed(self) -> &'static str {
        match self {
            Route::Session => "GET, POST, DELETE",
            Route::Messages => "GET, POST",
            Route::Member => "PUT, DELETE",
            _ => "GET",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_match_their_routes_with_the_parts_the_template_names() {
        let matched = |path| Route::of(path).map(|m| (m.route, m.id, m.user));
        assert_eq!(matched("/"), Some((Route::Page, "", "")));
        assert_eq!(
            matched("/chats/7/messages"),
            Some((Route::Messages, "7", ""))
        );
        assert_eq!(
            matched("/chats/7/members/ann%40x"),
            Some((Route::Member, "7", "ann%40x"))
        );
        assert_eq!(matched("/metrics"), Some((Route::AdminOnly, "", "")));
        for unknown in [
            "/chats",
            "/chats/7",
            "/chats/7/messages/8",
            "/x",
            "/chats//",
        ] {
            assert_eq!(matched(unknown), None, "{unknown}");
        }
    }

    #[test]
    fn labels_are_templates_and_name_no_id() {
        for path in [
            "/",
            "/page.js",
            "/page.css",
            "/healthz",
            "/session",
            "/chats/1/messages",
            "/chats/1/events",
            "/chats/1/members",
            "/chats/1/members/u",
        ] {
            let route = Route::of(path).unwrap().route;
            let label = Route::label(Some(route));
            assert_eq!(label, route.template());
            assert!(!label.contains('1') && !label.ends_with("/u"), "{label}");
        }
        assert_eq!(Route::label(None), "other");
        assert_eq!(Route::label(Some(Route::AdminOnly)), "other");
        assert_eq!(Route::Messages.template(), "/chats/{id}/messages");
        assert_eq!(Route::Member.allowed(), "PUT, DELETE");
    }
}
