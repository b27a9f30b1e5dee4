//! Chat messages: what clients send, what the API returns, what travels in the outbox event,
//! and the validation of each, with errors that name the problem.

use outbox_core::stream::entry::{EntryFields, MissingField};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::side::Side;

/// Longest message body, in characters (Unicode scalar values).
pub(crate) const MAX_BODY_CHARS: usize = 4000;
/// The outbox event type of a sent message.
pub const MESSAGE_CREATED: &str = "message.created";

/// A chat message as the API returns it and as the outbox event carries it.
/// Unknown fields in events are ignored, so a sender may add fields before receivers know them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub id: Uuid,
    pub chat_id: i64,
    pub body: String,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// The side that sent it.
    pub side: Side,
    /// Who wrote it: the subject of the sender's token. `None` for messages from before
    /// identities, or sent by a service run with `--allow-anonymous`.
    #[serde(default)]
    pub sender: Option<String>,
}

/// A message in a chat's feed as one side shows it (history, SSE, a send's answer).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct HistoryItem {
    #[serde(flatten)]
    pub message: Message,
    /// Its position in the chat's feed on this side (sent and received messages share
    /// it); the SSE event id is `p<pos>`.
    pub pos: i64,
}

/// Why a request is refused; the text is returned as `{"error": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error("chat_id must be a positive integer, got '{0}'")]
    ChatId(String),
    #[error("malformed JSON: {0}")]
    MalformedJson(String),
    #[error("the request body must be a JSON object like {{\"body\": \"...\"}}")]
    NotAnObject,
    #[error("body is missing")]
    BodyMissing,
    #[error("body must be a string")]
    BodyNotString,
    #[error("body is empty")]
    BodyEmpty,
    #[error("body has {0} characters; the limit is {MAX_BODY_CHARS}")]
    BodyTooLong(usize),
    #[error("body contains a NUL character")]
    BodyHasNul,
    #[error("unknown field '{0}'; only \"body\" is accepted")]
    UnknownField(String),
}

impl InputError {
    /// 413 for content that is too large, 400 for everything else.
    pub fn status(&self) -> u16 {
        match self {
            InputError::BodyTooLong(_) => 413,
            _ => 400,
        }
    }
}

/// `{chat_id}` from a path: ASCII digits, positive, fitting in a bigint.
pub fn parse_chat_id(raw: &str) -> Result<i64, InputError> {
    if raw.is_empty() || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return Err(InputError::ChatId(raw.into()));
    }
    match raw.parse::<i64>() {
        Ok(id) if id > 0 => Ok(id),
        _ => Err(InputError::ChatId(raw.into())),
    }
}

/// Longest user id (a token's `sub`), in bytes; the database checks the same bound.
pub(crate) const MAX_USER_ID_BYTES: usize = 255;

/// A user id as stored (a message's sender, a member to remove): 1 to 255 bytes, no control
/// characters, so it can be stored, logged and shown as it is.
pub(crate) fn check_user_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("a user id must not be empty".into());
    }
    if id.len() > MAX_USER_ID_BYTES {
        return Err(format!(
            "a user id has at most {MAX_USER_ID_BYTES} bytes, got {}",
            id.len()
        ));
    }
    if id.chars().any(char::is_control) {
        return Err("a user id must not contain control characters".into());
    }
    Ok(())
}

/// A user id coming in (a token's subject, a member added): also no invisible format
/// characters (bidirectional overrides and isolates, zero-width ones), which reorder or
/// hide what is shown. Ids stored before this check stay readable and removable.
pub(crate) fn check_new_user_id(id: &str) -> Result<(), String> {
    check_user_id(id)?;
    if let Some(c) = id.chars().find(|c| is_format(*c)) {
        return Err(format!(
            "a user id must not contain invisible format characters (U+{:04X}): they reorder or hide what is shown",
            u32::from(c)
        ));
    }
    Ok(())
}

/// Unicode's format characters (general category Cf): bidirectional embeddings, overrides
/// and isolates, zero-width joiners and spaces, the byte-order mark, tags.
fn is_format(c: char) -> bool {
    matches!(u32::from(c),
        0x00AD | 0x0600..=0x0605 | 0x061C | 0x06DD | 0x070F | 0x0890..=0x0891 | 0x08E2
        | 0x180E | 0x200B..=0x200F | 0x202A..=0x202E | 0x2060..=0x2064 | 0x2066..=0x206F
        | 0xFEFF | 0xFFF9..=0xFFFB | 0x110BD | 0x110CD | 0x13430..=0x1343F
        | 0x1BCA0..=0x1BCA3 | 0x1D173..=0x1D17A | 0xE0001 | 0xE0020..=0xE007F)
}

/// The body of `POST /chats/{id}/messages`: `{"body": "..."}`.
pub fn parse_send_request(raw: &[u8]) -> Result<String, InputError> {
    let value: serde_json::Value =
        serde_json::from_slice(raw).map_err(|e| InputError::MalformedJson(e.to_string()))?;
    let serde_json::Value::Object(mut fields) = value else {
        return Err(InputError::NotAnObject);
    };
    let body = fields.remove("body").ok_or(InputError::BodyMissing)?;
    if let Some(unknown) = fields.keys().next() {
        return Err(InputError::UnknownField(unknown.clone()));
    }
    let serde_json::Value::String(body) = body else {
        return Err(InputError::BodyNotString);
    };
    if body.trim().is_empty() {
        return Err(InputError::BodyEmpty);
    }
    let chars = body.chars().count();
    if chars > MAX_BODY_CHARS {
        return Err(InputError::BodyTooLong(chars));
    }
    // Postgres text cannot hold NUL.
    if body.contains('\0') {
        return Err(InputError::BodyHasNul);
    }
    Ok(body)
}

/// Why a stream entry cannot become an inbox row (it goes to the dead-letter stream).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PoisonError {
    #[error("entry has no '{0}' field")]
    MissingField(&'static str),
    #[error("unknown event type '{0}'")]
    UnknownEvent(String),
    #[error("payload is not a valid message: {0}")]
    BadPayload(String),
    #[error("message comes from side '{got}' but this stream carries '{expected}'")]
    WrongSide { expected: Side, got: Side },
    #[error("{0}")]
    Invalid(String),
}

impl From<MissingField> for PoisonError {
    fn from(e: MissingField) -> Self {
        PoisonError::MissingField(e.0)
    }
}

/// Parse a stream entry of the other side's stream, from a lookup of its fields.
pub(crate) fn parse_entry<'a>(
    field: impl Fn(&str) -> Option<&'a str>,
    from: Side,
) -> Result<Message, PoisonError> {
    let fields = EntryFields::decode(field)?;
    parse_event(fields.event, fields.payload, from)
}

/// Parse an outbox event from the other side's stream.
pub(crate) fn parse_event(event: &str, payload: &str, from: Side) -> Result<Message, PoisonError> {
    if event != MESSAGE_CREATED {
        return Err(PoisonError::UnknownEvent(event.chars().take(100).collect()));
    }
    let message: Message =
        serde_json::from_str(payload).map_err(|e| PoisonError::BadPayload(e.to_string()))?;
    if message.side != from {
        return Err(PoisonError::WrongSide {
            expected: from,
            got: message.side,
        });
    }
    if message.chat_id <= 0 {
        return Err(PoisonError::Invalid(format!(
            "chat_id {} is not positive",
            message.chat_id
        )));
    }
    if message.body.contains('\0') || message.body.chars().count() > MAX_BODY_CHARS {
        return Err(PoisonError::Invalid(
            "body holds NUL or is over the length limit".into(),
        ));
    }
    if let Some(sender) = &message.sender {
        if let Err(e) = check_user_id(sender) {
            return Err(PoisonError::Invalid(format!("sender: {e}")));
        }
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_ids() {
        assert_eq!(parse_chat_id("7"), Ok(7));
        assert_eq!(parse_chat_id("9223372036854775807"), Ok(i64::MAX));
        for bad in [
            "0",
            "-1",
            "+7",
            "7a",
            "",
            "1.5",
            "9223372036854775808",
            " 7",
        ] {
            assert_eq!(
                parse_chat_id(bad),
                Err(InputError::ChatId(bad.into())),
                "{bad}"
            );
        }
    }

    #[test]
    fn send_requests() {
        assert_eq!(parse_send_request(br#"{"body":"hi"}"#), Ok("hi".into()));
        let html = r#"{"body":"<script>alert(1)</script>"}"#;
        assert_eq!(
            parse_send_request(html.as_bytes()),
            Ok("<script>alert(1)</script>".into())
        );
        let cases: &[(&[u8], InputError)] = &[
            (b"{}", InputError::BodyMissing),
            (br#"{"body":""}"#, InputError::BodyEmpty),
            (br#"{"body":"  \n"}"#, InputError::BodyEmpty),
            (br#"{"body":5}"#, InputError::BodyNotString),
            (br#"{"body":null}"#, InputError::BodyNotString),
            (b"[1]", InputError::NotAnObject),
            (br#"{"body":"a\u0000b"}"#, InputError::BodyHasNul),
            (
                br#"{"body":"x","extra":1}"#,
                InputError::UnknownField("extra".into()),
            ),
        ];
        for (raw, expected) in cases {
            assert_eq!(&parse_send_request(raw).unwrap_err(), expected);
        }
        assert!(matches!(
            parse_send_request(b"{"),
            Err(InputError::MalformedJson(_))
        ));
        let long = format!(r#"{{"body":"{}"}}"#, "é".repeat(4001));
        assert_eq!(
            parse_send_request(long.as_bytes()),
            Err(InputError::BodyTooLong(4001))
        );
        let max = format!(r#"{{"body":"{}"}}"#, "é".repeat(4000));
        assert!(parse_send_request(max.as_bytes()).is_ok());
    }

    #[test]
    fn events() {
        let payload = r#"{"id":"0193c0de-8a4b-7cc1-9a1e-3f1d2e4b5a6c","chat_id":7,"body":"hi","created_at":"2026-11-29T21:12:00.123456Z","side":"consumers"}"#;
        let m = parse_event(MESSAGE_CREATED, payload, Side::Consumers).unwrap();
        assert_eq!(m.chat_id, 7);
        assert_eq!(
            parse_event(MESSAGE_CREATED, payload, Side::Workers),
            Err(PoisonError::WrongSide {
                expected: Side::Workers,
                got: Side::Consumers
            })
        );
        assert!(matches!(
            parse_event("x.y", payload, Side::Consumers),
            Err(PoisonError::UnknownEvent(_))
        ));
        assert!(matches!(
            parse_event(MESSAGE_CREATED, "{", Side::Consumers),
            Err(PoisonError::BadPayload(_))
        ));
        assert!(matches!(
            parse_event(MESSAGE_CREATED, r#"{"id":1}"#, Side::Consumers),
            Err(PoisonError::BadPayload(_))
        ));
        // An event of the previous version (no sender) is a message without one.
        assert_eq!(m.sender, None);
        let signed = payload.replace(r#""side""#, r#""sender":"alice","side""#);
        let m = parse_event(MESSAGE_CREATED, &signed, Side::Consumers).unwrap();
        assert_eq!(m.sender.as_deref(), Some("alice"));
        let bad = payload.replace(r#""side""#, r#""sender":"a\u0007b","side""#);
        assert!(matches!(
            parse_event(MESSAGE_CREATED, &bad, Side::Consumers),
            Err(PoisonError::Invalid(_))
        ));
    }

    #[test]
    fn user_ids() {
        assert!(check_user_id("alice").is_ok());
        assert!(check_user_id("Zoë-日本").is_ok());
        // "alice" shown, "ecila" stored; a zero-width space making a second "bob".
        for disguised in [
            "\u{202E}ecila",
            "bo\u{200B}b",
            "\u{2066}x\u{2069}",
            "\u{FEFF}bob",
        ] {
            assert!(
                check_new_user_id(disguised).unwrap_err().contains("format"),
                "{disguised:?}"
            );
            // One stored before the check can still be named (to remove it).
            assert!(check_user_id(disguised).is_ok(), "{disguised:?}");
        }
        assert!(check_user_id("auth0|5f1c").is_ok());
        assert!(check_user_id(&"x".repeat(255)).is_ok());
        assert!(check_user_id("").is_err());
        assert!(check_user_id(&"x".repeat(256)).is_err());
        assert!(check_user_id("a\nb").is_err());
    }
}
