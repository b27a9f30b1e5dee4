//! The inbox: received messages recorded once each under the shard's writer fence (claimed
//! by each new holder of the shard), in stream order, taking their feed positions.

use super::*;

/// Where [`Store::record_inbox`] put a message in its chat's feed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub struct Position {
    pub pos: i64,
    /// Recorded by this call (`false`: it was in the inbox already).
    pub new: bool,
    /// The row as the inbox holds it (written now or before): what is shown, whatever the
    /// entry carried (a redelivery republished with other content, or two entries of one
    /// batch with one id, must not show anything the database does not hold).
    pub recorded: Message,
}

/// A message to record into the inbox by [`Store::record_inbox`].
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub struct Received {
    pub stream_id: String,
    pub message: Message,
}

impl Store {
    /// Become the inbox's writer for `shard` (after taking its consumer lease): bump the
    /// shard's fencing epoch. Waits for a previous holder's in-flight write (bounded by
    /// `lock_timeout`, past which the consumer tries again), whose epoch it then
    /// invalidates.
    #[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
    pub async fn claim_inbox_writer(&self, holder: &str, shard: u32) -> Result<i64, StoreError> {
        on_connection!(self, |client, s| {
            let row = client
                .query_one(
                    &format!(
                    "INSERT INTO {s}.inbox_writer AS w (shard, holder, epoch) VALUES ($2, $1, 1)
                     ON CONFLICT (shard) DO UPDATE SET holder = $1, epoch = w.epoch + 1
                     RETURNING epoch"
                ),
                    &[&holder, &(shard as i32)],
                )
                .await?;
            Ok(row.get(0))
        })
    }

    /// The current epoch of `shard`'s inbox writer (for a write beside the writer: an
    /// operator's replay); 0 before any writer claimed the shard.
    pub(crate) async fn inbox_writer_epoch(&self, shard: u32) -> Result<i64, StoreError> {
        on_connection!(self, |client, s| {
            let row = client
                .query_opt(
                    &format!(
                        "WITH new AS (INSERT INTO {s}.inbox_writer (shard, holder, epoch) VALUES ($1, '', 0)
                                      ON CONFLICT (shard) DO NOTHING RETURNING epoch)
                         SELECT epoch FROM new UNION ALL SELECT epoch FROM {s}.inbox_writer WHERE shard = $1"
                    ),
                    &[&(shard as i32)],
                )
                .await?;
            match row {
                Some(row) => Ok(row.get(0)),
                // A first claim committed between the insert's conflict and the select's
                // snapshot: the row is there now.
                None => Ok(client
                    .query_one(
                        &format!("SELECT epoch FROM {s}.inbox_writer WHERE shard = $1"),
                        &[&(shard as i32)],
                    )
                    .await?
                    .get(0)),
            }
        })
    }

    /// Record received messages in one transaction, each once (by message id), in the
    /// given order, only while `epoch` is `shard`'s inbox writer's epoch (see
    /// [`Store::claim_inbox_writer`]); `Fenced` otherwise, with nothing written. Returns
    /// every message's feed position, whether recorded now or found there (a redelivery,
    /// to be announced again: its first announcement may never have gone out).
    #[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
    pub async fn record_inbox(
        &self,
        received: &[Received],
        shard: u32,
        epoch: i64,
    ) -> Result<HashMap<Uuid, Position>, StoreError> {
        let _probe = self.admit()?;
        let client = self.connection().await?;
        self.within(STATEMENT_DEADLINE, async {
        let s = self.side.schema();
        let mut ids = Vec::with_capacity(received.len());
        let mut chats = Vec::with_capacity(received.len());
        let mut bodies = Vec::with_capacity(received.len());
        let mut sent = Vec::with_capacity(received.len());
        let mut streams = Vec::with_capacity(received.len());
        let mut senders = Vec::with_capacity(received.len());
        for r in received {
            ids.push(r.message.id);
            chats.push(r.message.chat_id);
            bodies.push(r.message.body.as_str());
            sent.push(r.message.created_at);
            streams.push(r.stream_id.as_str());
            senders.push(r.message.sender.as_deref());
        }
        // One statement: the writer row locked FOR SHARE and its epoch checked, then the
        // rows inserted in the order of `ord` (stream order, so feed positions, taken by
        // the V7 trigger, follow the sender's commit order). The first output row (message
        // id NULL) carries the current epoch; then the rows written now; then those that
        // were there before (the statement's snapshot does not see its own inserts).
        let statement = client
            .prepare_cached(&format!(
                    "WITH w AS (SELECT epoch FROM {s}.inbox_writer WHERE shard = $7 FOR SHARE),
                          ins AS (
                            INSERT INTO {s}.inbox (message_id, chat_id, body, sent_at, stream_id, sender)
                            SELECT id, chat, body, sent, stream, sender
                              FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::timestamptz[], $5::text[], $8::text[])
                                   WITH ORDINALITY AS r(id, chat, body, sent, stream, sender, ord)
                             WHERE (SELECT epoch FROM w) = $6
                             ORDER BY ord
                            ON CONFLICT (message_id) DO NOTHING
                            RETURNING message_id, pos, chat_id, body, sent_at, sender)
                     SELECT NULL::uuid, (SELECT epoch FROM w), true,
                            NULL::bigint, NULL::text, NULL::timestamptz, NULL::text
                     UNION ALL
                     SELECT message_id, pos, true, chat_id, body, sent_at, sender FROM ins
                     UNION ALL
                     SELECT message_id, pos, false, chat_id, body, sent_at, sender FROM {s}.inbox
                      WHERE message_id = ANY($1) AND (SELECT epoch FROM w) = $6"
            ))
            .await?;
        let rows = client
            .query(
                &statement,
                &[
                    &ids,
                    &chats,
                    &bodies,
                    &sent,
                    &streams,
                    &epoch,
                    &(shard as i32),
                    &senders,
                ],
            )
            .await?;
        let mut recorded = HashMap::with_capacity(rows.len());
        for row in &rows {
            match row.get::<_, Option<Uuid>>(0) {
                Some(id) => {
                    recorded.insert(
                        id,
                        Position {
                            pos: row.get(1),
                            new: row.get(2),
                            recorded: Message {
                                id,
                                chat_id: row.get(3),
                                body: row.get(4),
                                created_at: row.get(5),
                                side: self.side.other(),
                                sender: row.get(6),
                            },
                        },
                    );
                }
                None => {
                    // No row: nobody ever claimed the shard, so no epoch is current.
                    let current: i64 = row.get::<_, Option<i64>>(1).unwrap_or(0);
                    if current != epoch {
                        return Err(StoreError::Fenced {
                            ours: epoch,
                            current,
                        });
                    }
                }
            }
        }
        Ok(recorded)
        })
        .await
    }

    /// Which of these message ids the inbox holds already.
    pub(crate) async fn inbox_holds(&self, ids: &[Uuid]) -> Result<Vec<Uuid>, StoreError> {
        on_connection!(self, |client, s| {
            let statement = client
                .prepare_cached(&format!(
                    "SELECT message_id FROM {s}.inbox WHERE message_id = ANY($1)"
                ))
                .await?;
            let rows = client.query(&statement, &[&ids]).await?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        })
    }
}
