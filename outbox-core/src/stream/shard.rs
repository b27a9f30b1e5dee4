//! Shards of a stream: which shard a message belongs to, and the key names of each shard.
//!
//! A stream split into N shards is N streams, one per shard, each with its own record and
//! rebuild lock. A message's shard is a stable hash of its outbox row's `partition_key`
//! (the chat id for chat messages) modulo N, so all messages of one chat live in one shard,
//! in commit order. N is fixed when the stream is set up and written into every shard's
//! record; every binary checks it (see [`check_recorded`]).
//!
//! Key names: with N = 1 the stream keeps its plain name (`outbox:consumers`, its record
//! `outbox:consumers:origin`), so single-stream deployments are unchanged. With N > 1
//! shard k is `outbox:consumers:{k}`, and every key of the shard starts with that name
//! (`outbox:consumers:{k}:origin`), so the `{k}` hash tag puts them on one Redis Cluster
//! node, where one script may touch them together.

use crate::error::ConfigError;

/// FNV-1a (64-bit) offset basis and prime: a hash anyone can reproduce in a few lines, in
/// any language, from the partition key's UTF-8 bytes.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Most shards a stream may have (each is a stream, a lease and a consumer task).
pub const MAX_SHARDS: u32 = 1024;

/// The shard of a row with `partition_key` (`None`: the column is NULL or absent, shard 0).
pub fn shard_of(partition_key: Option<&[u8]>, shards: u32) -> u32 {
    if shards <= 1 {
        return 0;
    }
    let Some(key) = partition_key else {
        return 0;
    };
    let mut hash = FNV_OFFSET;
    for byte in key {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    (hash % u64::from(shards)) as u32
}

/// The key of shard `shard` of the stream (or any per-shard key) named `base`.
pub fn shard_key(base: &str, shard: u32, shards: u32) -> String {
    if shards <= 1 {
        base.to_string()
    } else {
        format!("{base}:{{{shard}}}")
    }
}

/// The shard a key of a sharded stream names (`outbox:consumers:{3}` → 3); a plain key
/// is shard 0.
pub fn shard_of_key(key: &str) -> u32 {
    key.strip_suffix('}')
        .and_then(|k| k.rsplit_once(":{"))
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or(0)
}

/// Every shard's key, in shard order.
pub fn shard_keys(base: &str, shards: u32) -> Vec<String> {
    (0..shards.max(1))
        .map(|k| shard_key(base, k, shards))
        .collect()
}

/// Validate a configured shard count and the base key names it splits, every binary alike:
/// the count is within bounds, a Redis Cluster has at least two shards (a script touches a
/// shard's stream and its record together, and only the `{k}` hash tag puts them on one
/// node), and on a cluster no base name carries a hash tag of its own (`keys`: each flag
/// with the name it was given).
pub fn validate_layout(
    flag: &str,
    shards: u32,
    cluster: bool,
    keys: &[(&str, &str)],
) -> Result<u32, ConfigError> {
    if shards == 0 || shards > MAX_SHARDS {
        return Err(ConfigError(format!(
            "{flag} must be between 1 and {MAX_SHARDS} (got {shards})"
        )));
    }
    if cluster && shards < 2 {
        return Err(ConfigError::new("--redis-cluster needs --stream-shards 2 or more: a script touches a shard's stream and its record together, and only shard keys ({k}) put them on one cluster node"));
    }
    for (key_flag, base) in keys {
        if cluster && (base.contains('{') || base.contains('}')) {
            return Err(ConfigError(format!(
                "{key_flag} '{base}' must not contain '{{' or '}}' with --redis-cluster: the shard's {{k}} must be the first hash tag of its keys"
            )));
        }
    }
    Ok(shards)
}

/// The shard count a record states (records written before shards existed say nothing:
/// one shard).
pub fn recorded_count(field: Option<&str>) -> Option<u32> {
    match field {
        None => Some(1),
        Some(text) => text.parse().ok(),
    }
}

/// Refuse a shard count that differs from what the stream was set up with, saying what to
/// change. `recorded`: the count each existing record states.
pub fn check_recorded(
    base: &str,
    configured: u32,
    recorded: impl IntoIterator<Item = u32>,
) -> Result<(), ConfigError> {
    for count in recorded {
        if count != configured {
            return Err(ConfigError(format!(
                "stream {base} was set up with {count} shard(s) but this binary is configured with {configured} (--stream-shards / CDC_STREAM_SHARDS): give every binary of this side the same count, or resize by the drain-and-resize procedure in docs/deployment.md"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_shard_keeps_todays_names_and_shards_share_a_hash_tag() {
        assert_eq!(shard_key("outbox:consumers", 0, 1), "outbox:consumers");
        assert_eq!(shard_key("outbox:consumers", 3, 8), "outbox:consumers:{3}");
        assert_eq!(
            format!("{}:origin", shard_key("outbox:consumers", 3, 8)),
            "outbox:consumers:{3}:origin"
        );
        assert_eq!(shard_keys("s", 3), ["s:{0}", "s:{1}", "s:{2}"]);
        assert_eq!(shard_of_key("outbox:consumers:{3}"), 3);
        assert_eq!(shard_of_key("outbox:consumers"), 0);
        assert_eq!(shard_of_key("weird}"), 0);
    }

    #[test]
    fn the_hash_is_stable_and_spreads_chats() {
        // Fixed values: a change here moves every chat to another shard.
        assert_eq!(shard_of(Some(b"1"), 8), shard_of(Some(b"1"), 8));
        assert_eq!(shard_of(Some(b"42"), 1), 0);
        assert_eq!(shard_of(None, 8), 0);
        // FNV-1a("a") = 0xaf63dc4c8601ec8c
        assert_eq!(
            shard_of(Some(b"a"), 1 << 20),
            (0xaf63_dc4c_8601_ec8c_u64 % (1 << 20)) as u32
        );
        let mut counts = [0u32; 8];
        for chat in 0..8000 {
            counts[shard_of(Some(chat.to_string().as_bytes()), 8) as usize] += 1;
        }
        assert!(counts.iter().all(|c| (800..1200).contains(c)), "{counts:?}");
    }

    #[test]
    fn a_mismatch_says_what_to_change() {
        assert!(check_recorded("s", 8, [8, 8]).is_ok());
        let e = check_recorded("s", 8, [1]).unwrap_err();
        assert!(
            e.0.contains("set up with 1 shard") && e.0.contains("--stream-shards"),
            "{e}"
        );
        assert_eq!(recorded_count(None), Some(1));
        assert_eq!(recorded_count(Some("8")), Some(8));
        assert!(validate_layout("--stream-shards", 0, false, &[]).is_err());
        assert!(validate_layout("--stream-shards", MAX_SHARDS + 1, false, &[]).is_err());
    }

    #[test]
    fn a_cluster_refuses_one_shard_and_names_with_their_own_hash_tag() {
        let e = validate_layout("--stream-shards", 1, true, &[]).unwrap_err();
        assert!(e.0.contains("--stream-shards 2"), "{e}");
        assert_eq!(validate_layout("--stream-shards", 1, false, &[]), Ok(1));
        assert_eq!(validate_layout("--stream-shards", 2, true, &[]), Ok(2));
        let e = validate_layout(
            "--stream-shards",
            2,
            true,
            &[("--dead-letter-stream", "dl:{x}")],
        )
        .unwrap_err();
        assert!(
            e.0.contains("--dead-letter-stream") && e.0.contains("first hash tag"),
            "{e}"
        );
        assert!(validate_layout("--stream-shards", 2, false, &[("--stream", "s:{x}")]).is_ok());
        assert!(validate_layout(
            "--stream-shards",
            2,
            true,
            &[("--stream", "outbox:consumers")]
        )
        .is_ok());
    }
}
