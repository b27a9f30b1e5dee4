//! Chat members: who may read and post in a chat, added and removed by admins, checked on
//! every request and for every open event stream.

use super::*;

impl Store {
    /// Whether `user` is a member of chat `chat_id` on this side.
    pub(crate) async fn is_member(&self, chat_id: i64, user: &str) -> Result<bool, StoreError> {
        on_connection!(self, |client, s| {
            let statement = client
                .prepare_cached(&format!(
                    "SELECT EXISTS (SELECT 1 FROM {s}.chat_members WHERE chat_id = $1 AND user_id = $2)"
                ))
                .await?;
            Ok(client
                .query_one(&statement, &[&chat_id, &user])
                .await?
                .get(0))
        })
    }

    /// Make `user` a member of chat `chat_id`; `false` if they were one already.
    pub(crate) async fn add_member(
        &self,
        chat_id: i64,
        user: &str,
        by: &str,
    ) -> Result<bool, StoreError> {
        on_connection!(self, |client, s| {
            let added = client
                .execute(
                    &format!(
                        "INSERT INTO {s}.chat_members (chat_id, user_id, added_by) VALUES ($1, $2, $3)
                         ON CONFLICT DO NOTHING"
                    ),
                    &[&chat_id, &user, &by],
                )
                .await?;
            Ok(added == 1)
        })
    }

    /// End `user`'s membership of chat `chat_id`; `false` if they were no member.
    pub(crate) async fn remove_member(&self, chat_id: i64, user: &str) -> Result<bool, StoreError> {
        on_connection!(self, |client, s| {
            let removed = client
                .execute(
                    &format!("DELETE FROM {s}.chat_members WHERE chat_id = $1 AND user_id = $2"),
                    &[&chat_id, &user],
                )
                .await?;
            Ok(removed == 1)
        })
    }

    /// The members of chat `chat_id`, by user id.
    pub(crate) async fn members(&self, chat_id: i64) -> Result<Vec<String>, StoreError> {
        on_connection!(self, |client, s| {
            let rows = client
                .query(
                    &format!(
                        "SELECT user_id FROM {s}.chat_members WHERE chat_id = $1 ORDER BY user_id"
                    ),
                    &[&chat_id],
                )
                .await?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        })
    }

    /// Which of these `(chat, user)` pairs are memberships, in one query whatever their
    /// number (the open event streams of an instance are checked this way every second).
    pub(crate) async fn memberships(
        &self,
        pairs: &[(i64, String)],
    ) -> Result<std::collections::HashSet<(i64, String)>, StoreError> {
        on_connection!(self, |client, s| {
            let chats: Vec<i64> = pairs.iter().map(|(c, _)| *c).collect();
            let users: Vec<&str> = pairs.iter().map(|(_, u)| u.as_str()).collect();
            let statement = client
                .prepare_cached(&format!(
                    "SELECT m.chat_id, m.user_id
                       FROM unnest($1::bigint[], $2::text[]) AS p(chat_id, user_id)
                       JOIN {s}.chat_members m USING (chat_id, user_id)"
                ))
                .await?;
            let rows = client.query(&statement, &[&chats, &users]).await?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
    }
}
