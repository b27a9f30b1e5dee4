//! `chat-service dead-letters`: what an operator does with the entries the inbox consumer
//! could not record. `list` shows them with their reasons; `replay` records them in the
//! inbox once the cause is fixed (in their original stream order, each message once, shown
//! live like any other) and removes them; `drop` removes them. Every replay and drop is
//! written to `<dead-letter stream>:audit` with who did it: the subject of the operator's
//! admin token where the side verifies tokens (`by_source` `token`), else what `--by` says
//! (`stated`, development only). A sharded stream's consumers
//! dead-letter into one stream per shard (`<dead-letter stream>:{k}`, beside the shard's
//! keys on a cluster): the commands work over all of them.
//!
//! Runs as the service's own Postgres role and Redis user, with the service's configuration
//! (the same environment), beside running instances.

use std::collections::HashMap;
use std::io::Write;

use outbox_core::connect::RedisConn;
use outbox_core::stream::entry::{self, dead_letter};
use outbox_core::stream::{keys, shard_keys, shard_of_key};
use serde_json::json;

use crate::cli::{DeadLetterCommand, Selection};
use crate::config::ServiceConfig;
use crate::model::{self, Message, PoisonError};
use crate::store::{Received, Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum DeadLetterError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("no dead letter with id {0} (see `dead-letters list`)")]
    Unknown(String),
    #[error(
        "dead letter id {0} is in several dead-letter streams ({1}): name it as <stream>@<id>"
    )]
    Ambiguous(String, String),
    #[error(transparent)]
    Config(#[from] outbox_core::ConfigError),
    #[error("message {0} was recorded but has no feed position")]
    NoPosition(uuid::Uuid),
    #[error("writing the output: {0}")]
    Output(#[from] std::io::Error),
    #[error("the operator's token is refused: {0}")]
    Operator(String),
}

/// What a command did, for its exit status.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub done: usize,
    /// Selected entries left in place (a replay the inbox still refuses).
    pub left: usize,
}

/// One dead letter: its id in the dead-letter stream and the fields the consumer wrote
/// (`stream`, `id`, `reason`, `deliveries`, `entry.<field>` of the original entry).
struct DeadLetter {
    id: String,
    /// The dead-letter stream it is in.
    stream: String,
    fields: HashMap<String, String>,
}

impl DeadLetter {
    fn field(&self, name: &str) -> &str {
        self.fields.get(name).map_or("", String::as_str)
    }

    /// The original entry's stream id as numbers, for ordering (unparsable ones last).
    fn stream_order(&self) -> (u64, u64) {
        self.field(dead_letter::ID)
            .split_once('-')
            .and_then(|(ms, seq)| Some((ms.parse().ok()?, seq.parse().ok()?)))
            .unwrap_or((u64::MAX, u64::MAX))
    }

    /// The message it carries, parsed as the consumer would.
    fn message(&self, from: crate::side::Side) -> Result<Message, PoisonError> {
        model::parse_entry(
            |name| {
                self.fields
                    .get(&dead_letter::entry_field(name))
                    .map(String::as_str)
            },
            from,
        )
    }

    fn summary(&self) -> serde_json::Value {
        let body: String = serde_json::from_str::<serde_json::Value>(
            self.field(&dead_letter::entry_field(entry::PAYLOAD)),
        )
        .ok()
        .and_then(|p| p["body"].as_str().map(|b| b.chars().take(80).collect()))
        .unwrap_or_default();
        json!({
            "dead_letter_id": self.id,
            "dead_letter_stream": self.stream,
            "stream": self.field(dead_letter::STREAM),
            "stream_id": self.field(dead_letter::ID),
            "reason": self.field(dead_letter::REASON),
            "deliveries": self.field(dead_letter::DELIVERIES),
            "event": self.field(&dead_letter::entry_field(entry::EVENT)),
            "body": body,
        })
    }
}

/// Run `command` against the configured side, writing its report to `out`.
pub async fn run(
    config: &ServiceConfig,
    command: DeadLetterCommand,
    out: &mut impl Write,
) -> Result<Outcome, DeadLetterError> {
    let mut conn = config
        .redis
        .connect(std::time::Duration::from_secs(5))
        .await?;
    let streams = streams(config);
    match command {
        DeadLetterCommand::List { count } => list(&mut conn, &streams, count, out).await,
        DeadLetterCommand::Drop(selection) => {
            let by = operator(config, &selection).await?;
            drop_letters(&mut conn, &streams, &selection, &by, out).await
        }
        DeadLetterCommand::Replay(selection) => {
            let by = operator(config, &selection).await?;
            replay(config, &mut conn, &streams, &selection, &by, out).await
        }
    }
}

/// Who acts, for the audit log: the subject of the operator's admin token where the side
/// verifies tokens, else (development, `--allow-anonymous`) what `--by` says.
struct Operator {
    name: String,
    source: &'static str,
}

async fn operator(
    config: &ServiceConfig,
    selection: &Selection,
) -> Result<Operator, DeadLetterError> {
    let refuse = |message: &str| Err(outbox_core::ConfigError::new(message.to_string()).into());
    match (&config.verifier, &selection.by, &selection.token_file) {
        (Some(_), Some(_), None) => refuse(
            "--by (CHAT_OPERATOR): this side verifies tokens, so the audit log names the subject of the operator's token: give --token-file (CHAT_OPERATOR_TOKEN_FILE) instead",
        ),
        (Some(_), None, None) => refuse(
            "this side verifies tokens: give the operator's admin token of this side with --token-file (CHAT_OPERATOR_TOKEN_FILE); the audit log names its subject",
        ),
        // The token names the operator (a --by from the environment says nothing more).
        (Some(verifier), _, Some(file)) => {
            let token = outbox_core::connect::read_secret_file(file)?;
            verifier
                .fetch_once()
                .await
                .map_err(DeadLetterError::Operator)?;
            let who = verifier
                .verify(&token)
                .map_err(|e| DeadLetterError::Operator(e.to_string()))?;
            if !who.admin {
                return Err(DeadLetterError::Operator(format!(
                    "{} holds no admin rights on this side (the admin scope, and its audience and client where configured)",
                    who.user
                )));
            }
            Ok(Operator {
                name: who.user,
                source: "token",
            })
        }
        (None, _, Some(_)) => refuse(
            "--token-file: this side runs without identities (--allow-anonymous): say who you are with --by",
        ),
        (None, Some(by), None) if !by.trim().is_empty() => Ok(Operator {
            name: by.trim().to_string(),
            source: "stated",
        }),
        (None, _, None) => refuse("--by is required: who does it, for the audit log"),
    }
}

/// `list`: up to `count` dead letters, oldest first, one JSON line each.
async fn list(
    conn: &mut RedisConn,
    streams: &[String],
    count: usize,
    out: &mut impl Write,
) -> Result<Outcome, DeadLetterError> {
    let mut listed = 0;
    for stream in streams {
        let letters = range(conn, stream, "-", "+", count - listed).await?;
        for letter in &letters {
            writeln!(out, "{}", letter.summary())?;
        }
        listed += letters.len();
    }
    Ok(Outcome {
        done: listed,
        left: 0,
    })
}

/// `drop`: remove the selected dead letters, each with its audit entry.
async fn drop_letters(
    conn: &mut RedisConn,
    streams: &[String],
    selection: &Selection,
    by: &Operator,
    out: &mut impl Write,
) -> Result<Outcome, DeadLetterError> {
    let mut outcome = Outcome::default();
    for (stream, ids) in pick(conn, streams, selection).await? {
        let mut from = None;
        while let Some(letters) = next_page(conn, &stream, ids.as_deref(), &mut from).await? {
            for letter in &letters {
                if remove(conn, &stream, letter, by, "drop", &[]).await? {
                    writeln!(
                        out,
                        "{}",
                        json!({"dropped": letter.id, "dead_letter_stream": stream})
                    )?;
                    outcome.done += 1;
                } else {
                    writeln!(
                        out,
                        "{}",
                        json!({"not_dropped": letter.id, "dead_letter_stream": stream, "reason": "removed meanwhile by another command"})
                    )?;
                }
            }
        }
    }
    Ok(outcome)
}

/// `replay`: record the selected dead letters in the inbox (in their stream order, each
/// message once), remove them with their audit entries, and tell the instances to show them.
async fn replay(
    config: &ServiceConfig,
    conn: &mut RedisConn,
    streams: &[String],
    selection: &Selection,
    by: &Operator,
    out: &mut impl Write,
) -> Result<Outcome, DeadLetterError> {
    let store = Store::new(&config.postgres, config.side, 2)?;
    let mut outcome = Outcome::default();
    for (stream, ids) in pick(conn, streams, selection).await? {
        let mut from = None;
        while let Some(letters) = next_page(conn, &stream, ids.as_deref(), &mut from).await? {
            for letter in &letters {
                let recorded = match letter.message(config.side.other()) {
                    Ok(message) => record(&store, letter, message).await?,
                    Err(e) => Err(e.to_string()),
                };
                let (message, pos, new) = match recorded {
                    Ok(recorded) => recorded,
                    Err(reason) => {
                        writeln!(
                            out,
                            "{}",
                            json!({"not_replayed": letter.id, "dead_letter_stream": stream, "reason": reason})
                        )?;
                        outcome.left += 1;
                        continue;
                    }
                };
                let details = [
                    ("message_id", message.id.to_string()),
                    ("chat_id", message.chat_id.to_string()),
                    ("pos", pos.to_string()),
                    ("already_in_inbox", (!new).to_string()),
                ];
                // Recorded either way; if another command removed the letter meanwhile, its
                // audit entry is the one that stands.
                let removed = remove(conn, &stream, letter, by, "replay", &details).await?;
                writeln!(
                    out,
                    "{}",
                    json!({"replayed": letter.id, "dead_letter_stream": stream, "message_id": message.id, "chat_id": message.chat_id, "pos": pos, "already_in_inbox": !new, "removed_by_another_command": !removed})
                )?;
                outcome.done += 1;
            }
        }
    }
    if outcome.done > 0 {
        // Streams show the replayed messages now (else within --feed-check-interval).
        if let Err(e) = crate::live::hints::publish_resync(&config.redis, config.side).await {
            tracing::warn!(error = %e, "could not hint the instances; they show the replayed messages within --feed-check-interval");
        }
    }
    Ok(outcome)
}

/// The side's dead-letter streams: one per shard of the consumed stream, and first the
/// plain one when sharded on a single Redis (consumers from before shards existed wrote
/// there; none ever ran on a cluster, where its audit key would sit in another slot).
fn streams(config: &ServiceConfig) -> Vec<String> {
    let base = &config.inbox.dead_letter_stream;
    let mut streams = shard_keys(base, config.inbox.shards);
    if config.inbox.shards > 1 && !config.redis.is_cluster() {
        streams.insert(0, base.clone());
    }
    streams
}

/// The streams a selection touches, each with its named ids (`None`: every letter).
async fn pick(
    conn: &mut RedisConn,
    streams: &[String],
    selection: &Selection,
) -> Result<Vec<(String, Option<Vec<String>>)>, DeadLetterError> {
    if selection.all {
        return Ok(streams.iter().map(|s| (s.clone(), None)).collect());
    }
    let mut picked: Vec<(String, Option<Vec<String>>)> = Vec::new();
    for name in &selection.ids {
        let (stream, id) = match name.rsplit_once('@') {
            Some((stream, id)) if streams.iter().any(|s| s == stream) => {
                (stream.to_string(), id.to_string())
            }
            Some(_) => return Err(DeadLetterError::Unknown(name.clone())),
            None => {
                let mut holding = Vec::new();
                for stream in streams {
                    if range(conn, stream, name, name, 1).await?.len() == 1 {
                        holding.push(stream.clone());
                    }
                }
                match holding.len() {
                    0 => return Err(DeadLetterError::Unknown(name.clone())),
                    1 => (holding.pop().expect("one"), name.clone()),
                    _ => return Err(DeadLetterError::Ambiguous(name.clone(), holding.join(", "))),
                }
            }
        };
        match picked.iter_mut().find(|(s, _)| *s == stream) {
            Some((_, Some(ids))) => ids.push(id),
            _ => picked.push((stream, Some(vec![id]))),
        }
    }
    // In the streams' order: the pre-shard letters, older than any shard's, go first.
    picked.sort_by_key(|(stream, _)| streams.iter().position(|s| s == stream));
    Ok(picked)
}

/// The next page of the selection, in original stream order; `None` when done. Named ids
/// come as one page (every one must exist); `--all` pages through the stream, so a large
/// one is never held in memory at once.
async fn next_page(
    conn: &mut RedisConn,
    stream: &str,
    ids: Option<&[String]>,
    from: &mut Option<String>,
) -> Result<Option<Vec<DeadLetter>>, DeadLetterError> {
    const PAGE: usize = 500;
    let mut letters = if let Some(ids) = ids {
        if from.is_some() {
            return Ok(None);
        }
        *from = Some(String::new());
        let mut letters = Vec::new();
        for id in ids {
            let mut found = range(conn, stream, id, id, 1).await?;
            match found.pop() {
                Some(letter) if letter.id == *id => letters.push(letter),
                _ => return Err(DeadLetterError::Unknown(id.clone())),
            }
        }
        letters
    } else {
        let start = from.clone().unwrap_or_else(|| "-".into());
        let letters = range(conn, stream, &start, "+", PAGE).await?;
        match letters.last() {
            Some(last) => *from = Some(format!("({}", last.id)),
            None => return Ok(None),
        }
        letters
    };
    letters.sort_by_key(DeadLetter::stream_order);
    Ok(Some(letters))
}

/// Record one dead letter's message beside the inbox writer: `Ok((message, pos, new))`, or
/// `Err(reason)` when Postgres refuses the row itself (it stays a dead letter).
async fn record(
    store: &Store,
    letter: &DeadLetter,
    message: Message,
) -> Result<Result<(Message, i64, bool), String>, DeadLetterError> {
    // Recorded beside the writer of the shard the entry came from.
    let shard = shard_of_key(letter.field(dead_letter::STREAM));
    let batch = [Received {
        stream_id: letter.field(dead_letter::ID).to_string(),
        message,
    }];
    // The writer's epoch can move on between reading and writing it (a takeover); then read
    // it again. The replay's rows are ordinary inbox rows: positions come from the trigger.
    let mut attempts = 0;
    loop {
        let epoch = store.inbox_writer_epoch(shard).await?;
        match store.record_inbox(&batch, shard, epoch).await {
            Ok(positions) => {
                let [Received { message, .. }] = batch;
                let position = positions
                    .get(&message.id)
                    .ok_or_else(|| DeadLetterError::NoPosition(message.id))?;
                return Ok(Ok((position.recorded.clone(), position.pos, position.new)));
            }
            Err(StoreError::Fenced { .. }) if attempts < 5 => attempts += 1,
            Err(e) if e.is_row_refused() => return Ok(Err(format!("postgres refused it: {e}"))),
            Err(e) => return Err(e.into()),
        }
    }
}

/// XRANGE `start`..`end` of the dead-letter stream, at most `count`, paging as it goes.
async fn range(
    conn: &mut RedisConn,
    stream: &str,
    start: &str,
    end: &str,
    count: usize,
) -> Result<Vec<DeadLetter>, DeadLetterError> {
    const PAGE: usize = 1000;
    let mut letters = Vec::new();
    let mut from = start.to_string();
    while letters.len() < count {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(stream)
            .arg(&from)
            .arg(end)
            .arg("COUNT")
            .arg(PAGE.min(count - letters.len()))
            .query_async(conn)
            .await?;
        let n = reply.ids.len();
        for entry in reply.ids {
            let fields = entry
                .map
                .iter()
                .filter_map(|(k, v)| {
                    redis::from_redis_value_ref::<String>(v)
                        .ok()
                        .map(|v| (k.clone(), v))
                })
                .collect();
            from = format!("({}", entry.id);
            letters.push(DeadLetter {
                id: entry.id,
                stream: stream.to_string(),
                fields,
            });
        }
        if n < PAGE {
            break;
        }
    }
    Ok(letters)
}

/// Delete dead letter ARGV[1] from KEYS[1] and, if it was there, log ARGV[2..] to KEYS[2].
pub(crate) const REMOVE_BODY: &str = r#"
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
return 1
"#;

/// Delete the dead letter and log the action to `<stream>:audit`, atomically, if it was
/// still there (`false`: another command removed it meanwhile; nothing is logged).
async fn remove(
    conn: &mut RedisConn,
    stream: &str,
    letter: &DeadLetter,
    by: &Operator,
    action: &str,
    details: &[(&str, String)],
) -> Result<bool, DeadLetterError> {
    static REMOVE: std::sync::LazyLock<outbox_core::functions::Function> =
        std::sync::LazyLock::new(|| crate::functions::LIBRARY.function("remove_dead_letter"));
    let at = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .expect("formats");
    let mut invocation = REMOVE.key(stream);
    invocation
        .key(keys::dead_letter_audit_key(stream))
        .arg(&letter.id)
        .arg("action")
        .arg(action)
        .arg("by")
        .arg(&by.name)
        .arg("by_source")
        .arg(by.source)
        .arg("dead_letter_id")
        .arg(&letter.id)
        .arg("stream_id")
        .arg(letter.field(dead_letter::ID))
        .arg("reason")
        .arg(letter.field(dead_letter::REASON))
        .arg("at")
        .arg(at);
    for (k, v) in details {
        invocation.arg(*k).arg(v);
    }
    let removed: i64 = invocation.invoke_async(conn).await?;
    if removed == 1 {
        tracing::info!(action, by = %by.name, by_source = by.source, dead_letter_id = %letter.id, stream_id = %letter.field(dead_letter::ID), "dead letter removed");
    }
    Ok(removed == 1)
}
