//! Reading a chat's feed: history pages, replays after a position for event streams, and
//! the newest position of each chat (the tips).

use super::*;

/// A page of history, oldest first, and whether older messages within the page's limit
/// were left out for its byte bound.
#[derive(Debug)]
pub(crate) struct HistoryPage {
    pub items: Vec<HistoryItem>,
    pub more: bool,
}

impl Store {
    /// The chat as this side shows it, oldest first: sent and received messages in feed
    /// order (their per-chat position); `before` pages back from a message id. At most
    /// `limit` messages and, past the newest one, `max_bytes` of their bodies: the database
    /// sends no more than that, so a page of the longest messages costs what a page of
    /// short ones does (`more` says older ones were left out for it).
    pub(crate) async fn history(
        &self,
        chat_id: i64,
        limit: i64,
        before: Option<Uuid>,
        max_bytes: usize,
    ) -> Result<HistoryPage, StoreError> {
        on_connection!(self, |client, s| {
            let before_pos: Option<i64> = match before {
                None => None,
                Some(id) => {
                    let row = client
                        .query_opt(
                            &format!(
                                "SELECT pos FROM {s}.messages WHERE id = $1 AND chat_id = $2
                             UNION ALL
                             SELECT pos FROM {s}.inbox WHERE message_id = $1 AND chat_id = $2"
                            ),
                            &[&id, &chat_id],
                        )
                        .await?
                        .ok_or(StoreError::UnknownCursor(id))?;
                    Some(row.get(0))
                }
            };
            // The newest `limit`, then as many of them as fit `max_bytes` of bodies (the
            // newest always: one message is at most ~16 KB), counted by the database.
            let rows = client
                .query(
                    &format!(
                        "SELECT id, body, created_at, sent, pos, sender, available FROM (
                       SELECT newest.*,
                              sum(octet_length(body)) OVER (ORDER BY pos DESC) AS fetched,
                              count(*) OVER () AS available
                         FROM (
                           SELECT * FROM (
                              SELECT id, body, created_at, true AS sent, pos, sender FROM {s}.messages
                               WHERE chat_id = $1 AND pos < $2 ORDER BY pos DESC LIMIT $3) sent
                           UNION ALL
                           SELECT * FROM (
                              SELECT message_id, body, sent_at, false, pos, sender FROM {s}.inbox
                               WHERE chat_id = $1 AND pos < $2 ORDER BY pos DESC LIMIT $3) received
                           ORDER BY pos DESC
                           LIMIT $3) newest) counted
                     WHERE fetched - octet_length(body) < $4
                     ORDER BY pos DESC"
                    ),
                    &[
                        &chat_id,
                        &before_pos.unwrap_or(i64::MAX),
                        &limit,
                        &(max_bytes as i64),
                    ],
                )
                .await?;
            let available: i64 = rows.first().map_or(0, |r| r.get(6));
            let mut items: Vec<HistoryItem> = rows.iter().map(|r| self.item(chat_id, r)).collect();
            items.reverse();
            Ok(HistoryPage {
                more: available > items.len() as i64,
                items,
            })
        })
    }

    /// A feed row `(id, body, created_at, sent, pos, sender)` as a history item.
    fn item(&self, chat_id: i64, row: &tokio_postgres::Row) -> HistoryItem {
        let sent: bool = row.get(3);
        HistoryItem {
            message: Message {
                id: row.get(0),
                chat_id,
                body: row.get(1),
                created_at: row.get(2),
                side: if sent { self.side } else { self.side.other() },
                sender: row.get(5),
            },
            pos: row.get(4),
        }
    }

    /// The chat's feed after position `after`, in order (sent and received).
    pub(crate) async fn feed(
        &self,
        chat_id: i64,
        after: i64,
        limit: i64,
    ) -> Result<Vec<HistoryItem>, StoreError> {
        on_connection!(self, |client, s| {
            let statement = client
                .prepare_cached(&format!(
                    "SELECT * FROM (
                    SELECT id, body, created_at, true, pos, sender FROM {s}.messages
                     WHERE chat_id = $1 AND pos > $2 ORDER BY pos LIMIT $3) sent
                 UNION ALL
                 SELECT * FROM (
                    SELECT message_id, body, sent_at, false, pos, sender FROM {s}.inbox
                     WHERE chat_id = $1 AND pos > $2 ORDER BY pos LIMIT $3) received
                 ORDER BY pos
                 LIMIT $3"
                ))
                .await?;
            let rows = client
                .query(&statement, &[&chat_id, &after, &limit])
                .await?;
            Ok(rows.iter().map(|r| self.item(chat_id, r)).collect())
        })
    }

    /// The newest position of each chat's feed (chats with no message are absent). Every
    /// position up to it is final: readers that reach it missed nothing.
    pub(crate) async fn tips(&self, chats: &[i64]) -> Result<Vec<(i64, i64)>, StoreError> {
        on_connection!(self, |client, s| {
            let statement = client
                .prepare_cached(&format!(
                    "SELECT chat_id, last_pos FROM {s}.chats WHERE chat_id = ANY($1)"
                ))
                .await?;
            let rows = client.query(&statement, &[&chats]).await?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
    }

    /// The feed position a cursor of the previous event-id scheme (a side-wide inbox `seq`,
    /// before migration V7) stands for: the position of the last received message at or
    /// before it, or just before the first received after it if V7 (which numbered old rows
    /// by their sender's timestamp, not `seq` order) put that one lower; 0 if the client had
    /// seen nothing (`0` meant "from the beginning" then too). Messages sent after it are sent again; what a client already has, pages
    /// drop by message id.
    pub(crate) async fn position_of_inbox_seq(
        &self,
        chat_id: i64,
        seq: i64,
    ) -> Result<i64, StoreError> {
        on_connection!(self, |client, s| {
            let row = client
                .query_one(
                    &format!(
                        "SELECT least(
                       coalesce((SELECT pos FROM {s}.inbox WHERE chat_id = $1 AND seq <= $2
                                  ORDER BY seq DESC LIMIT 1), 0),
                       coalesce((SELECT min(pos) - 1 FROM {s}.inbox
                                  WHERE chat_id = $1 AND seq > $2), 9223372036854775807))"
                    ),
                    &[&chat_id, &seq],
                )
                .await?;
            Ok(row.get(0))
        })
    }
}
