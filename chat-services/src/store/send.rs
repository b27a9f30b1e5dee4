//! Sending: a message and its outbox event in one transaction, each Idempotency-Key once
//! per sender, and the outcome of a send whose commit went unanswered resolved by its key.

use super::*;

/// An Idempotency-Key as stored: each sender's keys are their own (two users choosing the
/// same key never meet, nor learn of each other's messages). A user id holds no control
/// character and a key only visible ASCII, so the separator is unambiguous. Keys of
/// anonymous sends, and of every send before identities, are stored as they are.
fn stored_key(sender: Option<&str>, key: &str) -> String {
    match sender {
        Some(sender) => format!("{sender}\u{1f}{key}"),
        None => key.to_string(),
    }
}

/// One send's statement, runnable again with the same message id and key.
struct Send<'a> {
    message: &'a Message,
    /// The key as stored: scoped to the sender (see [`stored_key`]).
    key: &'a str,
    /// The key as the client knows it (answered with an unknown outcome).
    client_key: &'a str,
    payload: &'a serde_json::Value,
    /// The sending request's trace context, for the outbox row.
    traceparent: Option<&'a str>,
}

impl Send<'_> {
    /// [`Send::execute`], given up at `deadline`: an attempt that had no answer by then
    /// may have committed (its outcome is unknown), and the connections it used are not
    /// trusted again.
    /// The wait for a pooled connection (bounded on its own, see [`Store::connection`]) moves
    /// the deadline by as much: a busy pool is not a database that stopped answering.
    async fn execute_by(&self, store: &Store, deadline: tokio::time::Instant) -> Attempt {
        let _probe = match store.admit() {
            Ok(admitted) => admitted,
            Err(refused) => return Attempt::Refused(refused),
        };
        let waiting = tokio::time::Instant::now();
        let client = match store.connection().await {
            Ok(client) => client,
            Err(e) => return Attempt::Refused(e),
        };
        let deadline = deadline + waiting.elapsed();
        match tokio::time::timeout_at(deadline, self.execute(store, &client)).await {
            Ok(attempt) => {
                if matches!(
                    attempt,
                    Attempt::Done(_)
                        | Attempt::Refused(
                            StoreError::Other(_)
                                | StoreError::RowRefused(_)
                                | StoreError::NotMember { .. }
                        )
                ) {
                    store.breaker.answered();
                }
                attempt
            }
            Err(_) => {
                store.breaker.trip();
                store.pool.retain(|_, _| false);
                Attempt::Unknown("no answer from the database in time".into())
            }
        }
    }

    /// One statement, so one round trip and atomic without an explicit transaction: the
    /// outbox row exists exactly when the message row does. `ON CONFLICT DO NOTHING` covers
    /// both the message id and the key, so running it again never writes twice. The outbox
    /// row's partition key is the chat (its stream shard, see `outbox_core::stream`). The chat
    /// feed position comes back when the message was written now (the trigger of migration
    /// V7 assigns it).
    async fn execute(&self, store: &Store, client: &deadpool_postgres::Object) -> Attempt {
        let s = store.side.schema();
        let statement = match client
            .prepare_cached(&format!(
                "WITH member AS (
                   SELECT $8::text IS NULL
                       OR EXISTS (SELECT 1 FROM {s}.chat_members
                                   WHERE chat_id = $2 AND user_id = $8 FOR KEY SHARE)
                       OR EXISTS (SELECT 1 FROM {s}.messages WHERE idempotency_key = $5) AS holds
                 ),
                 m AS (
                   INSERT INTO {s}.messages (id, chat_id, body, created_at, idempotency_key, sender)
                   SELECT $1, $2, $3, $4, $5, $8 FROM member WHERE member.holds
                   ON CONFLICT DO NOTHING
                   RETURNING pos, chat_id
                 ),
                 o AS (INSERT INTO {s}.outbox (event, payload, partition_key, traceparent)
                       SELECT $6, $7, chat_id::text, $9 FROM m)
                 SELECT (SELECT pos FROM m), (SELECT holds FROM member)"
            ))
            .await
        {
            Ok(statement) => statement,
            Err(e) => return Attempt::Refused(e.into()),
        };
        let m = self.message;
        let executed = client
            .query_one(
                &statement,
                &[
                    &m.id,
                    &m.chat_id,
                    &m.body,
                    &m.created_at,
                    &self.key,
                    &MESSAGE_CREATED,
                    self.payload,
                    &m.sender,
                    &self.traceparent,
                ],
            )
            .await;
        match executed {
            // The sender left the chat since the request was admitted (while its body
            // arrived, say): the membership is checked in the statement that inserts, its
            // row locked (a removal waits for the send, or the send sees it gone). A key
            // already written (this very send, committed before its connection broke) is
            // answered as before: the message went in while they were a member.
            Ok(row) if !row.get::<_, bool>(1) => Attempt::Refused(StoreError::NotMember {
                chat_id: self.message.chat_id,
            }),
            Ok(row) => Attempt::Done(row.get(0)),
            // The server answered with an ERROR: the statement (and its commit) failed. A
            // FATAL (an immediate shutdown, a crash restart) may follow a commit: unknown.
            Err(e)
                if e.as_db_error().is_some_and(|db| {
                    db.parsed_severity() == Some(tokio_postgres::error::Severity::Error)
                }) =>
            {
                Attempt::Refused(e.into())
            }
            Err(e) => Attempt::Unknown(e.to_string()),
        }
    }
}

/// What one run of a send's statement did.
enum Attempt {
    /// Ran to completion: the message's feed position if written now, `None` if it was
    /// already there.
    Done(Option<i64>),
    /// Certainly not written (it never reached the server, or the server refused it).
    Refused(StoreError),
    /// Sent, and no answer: written or not.
    Unknown(String),
}

/// A sent message with its place in the chat's feed.
#[derive(Debug, Clone)]
pub(crate) struct Sent {
    pub item: HistoryItem,
    /// The Idempotency-Key was used before: this is the original, nothing was written.
    pub replayed: bool,
}

impl Store {
    /// Write the message and its outbox event in one transaction. With an idempotency key
    /// already used for the same chat and body, return the original (a replay) and write
    /// nothing.
    pub(crate) async fn send(
        &self,
        chat_id: i64,
        body: &str,
        idempotency_key: Option<&str>,
        sender: Option<&str>,
        traceparent: Option<&str>,
    ) -> Result<Sent, StoreError> {
        // The message's timestamp comes from here (like its UUIDv7), at the database's
        // microsecond precision, so the event carries exactly what is stored and answered.
        let now = OffsetDateTime::now_utc();
        let created_at = now
            .replace_nanosecond(now.nanosecond() / 1_000 * 1_000)
            .expect("valid nanosecond");
        let message = Message {
            id: Uuid::now_v7(),
            chat_id,
            body: body.to_string(),
            created_at,
            side: self.side,
            sender: sender.map(str::to_string),
        };
        let payload = serde_json::to_value(&message).expect("message serializes");
        // Every send has a key: the client's, or one of ours, so that an outcome we cannot
        // learn (Postgres unreachable for the whole resolution window) can still be retried
        // safely by the client with the key we answer.
        let key = idempotency_key
            .map(str::to_string)
            .unwrap_or_else(|| format!("auto:{}", message.id));
        let stored = stored_key(sender, &key);
        let send = Send {
            message: &message,
            key: &stored,
            client_key: &key,
            payload: &payload,
            traceparent,
        };
        let deadline = tokio::time::Instant::now() + RESOLVE_WITHIN;
        let written = match send.execute_by(self, deadline).await {
            Attempt::Done(written) => written,
            Attempt::Refused(e) => return Err(e),
            // The statement went out and no answer came back (the connection broke): it
            // may have committed. Send it again: the same message id and key make a second
            // run write nothing if the first committed, and wait for it if still running.
            Attempt::Unknown(e) => {
                warn!(error = %e, message_id = %message.id, "send's outcome unknown (connection lost); resolving");
                self.resolve(&send, deadline).await?
            }
        };
        if let Some(pos) = written {
            return Ok(Sent {
                item: HistoryItem { message, pos },
                replayed: false,
            });
        }
        // The key was there already: the client's key used before, or this very send
        // (our own key or the client's), committed before its connection broke. Answer
        // the original. Failing to read it now leaves the outcome unknown, not "nothing
        // written".
        let unknown = || StoreError::OutcomeUnknown {
            idempotency_key: key.clone(),
        };
        let row: Result<tokio_postgres::Row, StoreError> = on_connection!(self, |client, s| {
            Ok(client
                .query_one(
                    &format!("SELECT id, chat_id, body, created_at, pos, sender FROM {s}.messages WHERE idempotency_key = $1"),
                    &[&stored],
                )
                .await?)
        });
        let row = row.map_err(|_| unknown())?;
        let original = Message {
            id: row.get(0),
            chat_id: row.get(1),
            body: row.get(2),
            created_at: row.get(3),
            side: self.side,
            sender: row.get(5),
        };
        // Another user's key is a mismatch too: a replay answers only its own sender.
        if original.chat_id != chat_id
            || original.body != body
            || original.sender.as_deref() != sender
        {
            return Err(StoreError::IdempotencyMismatch {
                chat_id: original.chat_id,
            });
        }
        // The same message id: this very send, committed before its connection broke.
        let replayed = original.id != message.id;
        Ok(Sent {
            item: HistoryItem {
                message: original,
                pos: row.get(4),
            },
            replayed,
        })
    }

    /// Run `send` again on fresh connections until its outcome is known, or `deadline`
    /// (5 s after the send began).
    async fn resolve(
        &self,
        send: &Send<'_>,
        deadline: tokio::time::Instant,
    ) -> Result<Option<i64>, StoreError> {
        let mut pause = Duration::from_millis(50);
        loop {
            // Only a completed rerun settles it: a rerun refused (say by a read-only node
            // after a failover) says nothing about whether the first attempt committed.
            let e = match send.execute_by(self, deadline).await {
                Attempt::Done(written) => return Ok(written),
                Attempt::Refused(e) => e.to_string(),
                Attempt::Unknown(e) => e,
            };
            if tokio::time::Instant::now() + pause > deadline {
                warn!(error = %e, key = %send.client_key, "send's outcome still unknown");
                return Err(StoreError::OutcomeUnknown {
                    idempotency_key: send.client_key.to_string(),
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }
}
