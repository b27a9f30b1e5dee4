//! Retention: the outbox rows and, when asked, the messages older than their retention,
//! deleted in small batches.

use super::*;

/// The least UUIDv7 of `at`'s millisecond: every id below it was made earlier.
fn least_uuid_v7_of(at: std::time::SystemTime) -> Uuid {
    let ms = at
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64;
    let mut bytes = [0u8; 16];
    bytes[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    bytes[6] = 0x70; // version 7
    bytes[8] = 0x80; // RFC 4122 variant
    Uuid::from_bytes(bytes)
}

impl Store {
    /// Delete up to `batch` of this side's sent messages written before `older_than`, or of
    /// its received messages recorded before it; returns how many. Sent messages are found
    /// by their UUIDv7 ids (time first), received ones by their inbox sequence (the order
    /// they were recorded in): a range of an index, oldest first, however large the table.
    /// A received message goes by when it was *recorded*, not sent: its row is what keeps a
    /// redelivery from being recorded twice, and a delivery can come long after the send.
    pub(crate) async fn delete_old_messages(
        &self,
        sent: bool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let cutoff = std::time::SystemTime::now()
            .checked_sub(older_than)
            .unwrap_or(std::time::UNIX_EPOCH);
        let bound = least_uuid_v7_of(cutoff);
        let cutoff = OffsetDateTime::from(cutoff);
        on_connection!(self, |client, s| {
            let deleted = if sent {
                let statement = client
                    .prepare_cached(&format!(
                        "DELETE FROM {s}.messages WHERE id IN (
                           SELECT id FROM {s}.messages
                            WHERE id < $1 AND created_at < $2
                            ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED)"
                    ))
                    .await?;
                client
                    .execute(&statement, &[&bound, &cutoff, &batch])
                    .await?
            } else {
                // The oldest `batch` rows by sequence, of which those recorded before the
                // cutoff: the scan reads `batch` rows at most, whatever the table holds.
                let statement = client
                    .prepare_cached(&format!(
                        "DELETE FROM {s}.inbox WHERE seq IN (
                           SELECT seq FROM (SELECT seq, received_at FROM {s}.inbox
                                             ORDER BY seq LIMIT $2
                                             FOR UPDATE SKIP LOCKED) oldest
                            WHERE received_at < $1)"
                    ))
                    .await?;
                client.execute(&statement, &[&cutoff, &batch]).await?
            };
            Ok(deleted)
        })
    }

    /// Delete up to `batch` outbox rows older than `older_than`; returns how many. Deletes
    /// are not published (the publication sends inserts only); rows locked by someone else
    /// are skipped, so concurrent instances share the work instead of waiting.
    pub(crate) async fn delete_old_outbox(
        &self,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        on_connection!(self, |client, s| {
            let statement = client
                .prepare_cached(&format!(
                    "DELETE FROM {s}.outbox WHERE id IN (
                   SELECT id FROM {s}.outbox
                    WHERE created_at < now() - make_interval(secs => $1)
                    ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)"
                ))
                .await?;
            Ok(client
                .execute(&statement, &[&older_than.as_secs_f64(), &batch])
                .await?)
        })
    }
}
