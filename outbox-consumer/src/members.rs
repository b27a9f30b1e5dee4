//! Sharing a sharded stream's shards among the instances of one consumer group.
//!
//! Each instance heartbeats into a sorted set of members (scored by Redis's clock, so hosts'
//! clocks do not matter) and reads the live ones back; [`assign`] splits the shards over
//! them evenly, moving few when one joins or leaves. Everyone computes the same split from the same view; while
//! views differ (a member joined or died moments ago) the per-shard lease decides, and an
//! instance gives a shard up as soon as its view says another live member wants it. A dead
//! member drops out of the view within the lease TTL, when its leases have expired too.
//! Ownership is only ever the lease's (fenced per shard in the database); the split only says
//! who tries.
//!
//! Only an instance that can consume is a member: one whose shard count the stream's records
//! refuse leaves the set, and so does one that cannot reach the database *while another member can*
//! (for a heartbeat period, it heartbeat after the database answers while this one's checks kept
//! failing), so its share goes to the others instead of stalling behind it. An outage nobody
//! can consume through (the database down or frozen for everyone) moves nothing: each keeps its
//! shards, and resumes them the moment the database answers, instead of handing them around when it
//! comes back. Each heartbeat's score says whether its database check passed (a half
//! millisecond added). When no instance is a member (every one started during an outage), every
//! instance tries every shard, as with one shard, so consuming resumes wherever it can first.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::connect::{RedisConn, RedisTarget};
use outbox_core::stream::keys;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::inbox::Inbox;
use crate::status::ShardRoles;

/// How long one look at (or heartbeat into) the member set may take.
const BEAT_WAIT: Duration = Duration::from_secs(2);

/// How often an instance looks at the live members between heartbeats.
const VIEW_REFRESH: Duration = Duration::from_millis(250);

/// Which shards this instance should try to hold (index: shard).
pub(crate) type Assignment = Arc<Vec<bool>>;

/// Heartbeat, leave, or only look, then Redis's time (ms), whether this member is out of the
/// set, whether another live member's last heartbeat came after a database answer and after
/// ARGV[4], and the live members. KEYS[1]: the members' sorted set; ARGV: member, liveness window (ms), mode, the
/// time this member's database checks began to fail (0 if they pass). Modes: '1' heartbeat
/// after a database answer (the score's half millisecond says so), '4' heartbeat after a
/// failed check, '0' leave, '2' only look. Scores are built as strings: Lua's own
/// formatting keeps 14 digits.
pub(crate) const MEMBERS_BODY: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
local mode = ARGV[3]
local out = 0
local able = 0
if ARGV[4] ~= '0' then
  -- Only live members count: a dead one's last score stays in the set for 10 windows.
  local from = math.max(tonumber(ARGV[4]), now - window)
  local since = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. string.format('%d', from), '+inf', 'WITHSCORES')
  for i = 1, #since, 2 do
    local score = tonumber(since[i + 1])
    if since[i] ~= ARGV[1] and score - math.floor(score) > 0.25 then
      able = 1
    end
  end
end
if mode == '1' then
  redis.call('ZADD', KEYS[1], string.format('%d.5', now), ARGV[1])
elseif mode == '4' then
  redis.call('ZADD', KEYS[1], string.format('%d', now), ARGV[1])
elseif mode == '0' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  out = 1
end
if mode ~= '2' then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - 10 * window))
end
local live = redis.call('ZRANGEBYSCORE', KEYS[1], now - window, '+inf')
table.insert(live, 1, tostring(able))
table.insert(live, 1, tostring(out))
table.insert(live, 1, string.format('%d', now))
return live
"#;
static MEMBERS: std::sync::LazyLock<outbox_core::functions::Function> =
    std::sync::LazyLock::new(|| crate::functions::LIBRARY.function("members"));

/// The shards `me` wants among `members` (any order); with no members at all, every shard
/// (everyone competes). Balanced rendezvous hashing: each shard ranks the members by a hash
/// of (member, shard) and goes to the first that still has room, where every member has
/// room for ⌊N/m⌋ and the ⌊N⌋ mod m left over go one each to their first members with no
/// extra yet. So counts differ by at most one, and a member joining or leaving moves little
/// more than its own share (plain `k mod m` would move most shards).
pub(crate) fn assign(shards: u32, members: &[String], me: &str) -> Vec<bool> {
    if members.is_empty() {
        return vec![true; shards as usize];
    }
    let mut sorted: Vec<&str> = members.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    sorted.dedup();
    let m = sorted.len();
    let floor = shards as usize / m;
    let ranked = |k: u32| {
        let mut order: Vec<usize> = (0..m).collect();
        order.sort_by_key(|i| std::cmp::Reverse(weight(sorted[*i], k)));
        order
    };
    let mut count = vec![0usize; m];
    let mut extra = vec![false; m];
    let mut owner = vec![usize::MAX; shards as usize];
    let mut left = Vec::new();
    for k in 0..shards {
        match ranked(k).into_iter().find(|i| count[*i] < floor) {
            Some(i) => {
                owner[k as usize] = i;
                count[i] += 1;
            }
            None => left.push(k),
        }
    }
    for k in left {
        if let Some(i) = ranked(k).into_iter().find(|i| !extra[*i]) {
            owner[k as usize] = i;
            extra[i] = true;
        }
    }
    let me = sorted.iter().position(|m| *m == me);
    owner.iter().map(|o| Some(*o) == me).collect()
}

/// The rendezvous weight of `member` for shard `k` (FNV-1a, stable across processes).
pub(crate) fn weight(member: &str, k: u32) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in member.bytes().chain(k.to_le_bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// What the membership task needs.
pub(crate) struct Membership<I> {
    pub(crate) client: RedisTarget,
    pub(crate) group: String,
    pub(crate) me: String,
    pub(crate) shards: u32,
    pub(crate) ttl: Duration,
    /// Asked whether this instance can record (`Inbox::ping`).
    pub(crate) inbox: Arc<I>,
    pub(crate) roles: Arc<ShardRoles>,
}

/// What this instance says of itself in the member set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// Its database check passed.
    Able,
    /// A check failed, or the database has not answered for a while but no other member has
    /// either: it stays, and keeps its shards.
    Unanswered,
    /// Out of the set: it cannot consume and another member can (or its layout is refused).
    Out(&'static str),
}

/// Keep this instance in the member set while it can consume, and `assignment` up to date,
/// until `shutdown`; then leave, so the others take its shards at once.
pub(crate) async fn run_membership<I: Inbox>(
    m: Membership<I>,
    assignment: watch::Sender<Assignment>,
    shutdown: CancellationToken,
) {
    let key = keys::inbox_members_key(&m.group);
    let mut conn: Option<RedisConn> = None;
    let mut heart = Heart::new(m.ttl);
    loop {
        if conn.is_none() {
            conn = m.client.connect(Duration::from_secs(2)).await.ok();
        }
        // A heartbeat (with the check that this instance can consume) every third of the
        // TTL; in between only a look at the live members, so a member joining or leaving
        // moves its shards within VIEW_REFRESH, not a heartbeat later.
        let beat_now = tokio::time::Instant::now() >= heart.next_beat;
        if beat_now {
            let answered = m.inbox.ping(m.ttl / 3).await.is_ok();
            heart.checked(answered);
        }
        let (mode, out_why) = heart.say(beat_now, m.roles.layout_refused());
        if let Some(c) = conn.as_mut() {
            match heart
                .beat(c, &key, &m.me, mode, heart.failing_since())
                .await
            {
                Ok(reply) => {
                    if let Some((members, standing)) = heart.saw(reply, mode, out_why) {
                        announce(&m, &assignment, &members, standing);
                    }
                }
                // Keep the last view: the leases still decide, and a member that cannot
                // reach Redis cannot consume anyway. Without one yet (a process started while
                // the set's node is down), want every shard: the leases let it take only
                // those nobody holds, so shards on the other nodes do not wait for this one.
                Err(e) => {
                    warn!(error = %e, "inbox membership heartbeat failed; retrying");
                    if heart.last.is_none() && mode != "0" {
                        let every = vec![true; m.shards as usize];
                        if **assignment.borrow() != every {
                            warn!("the inbox member set cannot be read: this instance takes any shard whose lease is free until it can");
                            assignment.send_replace(Arc::new(every));
                        }
                    }
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(VIEW_REFRESH.min(m.ttl / 3)) => {}
        }
    }
    if let Some(c) = conn.as_mut() {
        // Not bounded by the heartbeat's deadline: leaving is the last thing this instance
        // does, and the connection's own response timeout bounds it.
        if let Err(e) = members(c, &key, &m.me, m.ttl, "0", 0).await {
            warn!(error = %e, "could not leave the inbox member set; the others notice within the lease TTL");
        }
    }
}

/// One call of the members script (see [`MEMBERS`]): the liveness window is the lease TTL.
async fn members(
    conn: &mut RedisConn,
    key: &str,
    me: &str,
    ttl: Duration,
    mode: &str,
    failing_since: u64,
) -> redis::RedisResult<Vec<String>> {
    MEMBERS
        .key(key)
        .arg(me)
        .arg(ttl.as_millis() as u64)
        .arg(mode)
        .arg(failing_since)
        .invoke_async(conn)
        .await
}

/// A new view of the members: the shards this instance wants now, said and sent.
fn announce<I>(
    m: &Membership<I>,
    assignment: &watch::Sender<Assignment>,
    members: &[String],
    standing: Standing,
) {
    let mine = assign(m.shards, members, &m.me);
    let wanted: Vec<usize> = (0..mine.len()).filter(|k| mine[*k]).collect();
    match standing {
        Standing::Able => {
            info!(?members, shards = ?wanted, "inbox members changed; shards wanted by this instance")
        }
        Standing::Unanswered => {
            warn!(?members, shards = ?wanted, "the database does not answer this instance; it keeps its shards while no other instance does better")
        }
        Standing::Out(why) => {
            warn!(?members, shards = ?wanted, why, "this instance cannot consume: out of the inbox member set, its shards go to the others")
        }
    }
    assignment.send_replace(Arc::new(mine));
}

/// What one instance knows of its own heartbeats: its database checks, and the last view of
/// the members it acted on.
struct Heart {
    ttl: Duration,
    next_beat: tokio::time::Instant,
    /// Checks failed in a row: one slow answer under load is not a reason to move shards.
    failed_checks: u32,
    /// Redis's time at the first heartbeat after the checks began to fail: a member that
    /// heartbeat after a database answer since then can consume where this one cannot.
    failing_since: Option<u64>,
    /// An instance that has never reached the database does not join while it cannot: its
    /// share would wait on it.
    ever_able: bool,
    /// Since when another member has been seen reaching the database while this one cannot.
    /// It leaves only once that has lasted a heartbeat period: after an outage of
    /// everyone's, the first to see the database again must not push out the others, whose
    /// checks pass moments later.
    others_able_since: Option<tokio::time::Instant>,
    /// The members and this instance's standing last acted on.
    last: Option<(Vec<String>, Standing)>,
}

impl Heart {
    fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            next_beat: tokio::time::Instant::now(),
            failed_checks: 0,
            failing_since: None,
            ever_able: false,
            others_able_since: None,
            last: None,
        }
    }

    /// The database check of this heartbeat `answered` or not.
    fn checked(&mut self, answered: bool) {
        self.failed_checks = if answered { 0 } else { self.failed_checks + 1 };
        // While the database fails, look again at once (a check waiting on a frozen server
        // returns as soon as it answers): the instance is back in the member set, and takes
        // its shards again, within moments of the database, not a third of the TTL.
        self.next_beat = tokio::time::Instant::now()
            + if answered {
                self.ttl / 3
            } else {
                Duration::ZERO
            };
        if answered {
            self.failing_since = None;
            self.ever_able = true;
        }
    }

    /// What to say in the set (the script's mode), and why this instance would be out of it.
    fn say(&self, beat_now: bool, layout_refused: bool) -> (&'static str, Option<&'static str>) {
        if !beat_now {
            ("2", None)
        } else if layout_refused {
            (
                "0",
                Some("the stream's records refuse this instance's shard count"),
            )
        } else if self.failed_checks == 0 {
            ("1", None)
        } else if !self.ever_able {
            // Joining while it cannot would give it a share, to wait on it.
            (
                "0",
                Some("the database has not answered since this instance started"),
            )
        } else if self.failed_checks < 3 || self.failing_since.is_none() {
            ("4", None)
        } else if matches!(self.last, Some((_, Standing::Out(_))))
            || self
                .others_able_since
                .is_some_and(|t| t.elapsed() >= self.ttl / 3)
        {
            // Out until the database answers: rejoining would move its share back, to wait.
            (
                "0",
                Some("the database does not answer, and another instance's does"),
            )
        } else {
            ("4", None)
        }
    }

    /// Since when (Redis's ms) this instance's checks fail, as the script takes it (0: they
    /// pass).
    fn failing_since(&self) -> u64 {
        match self.failed_checks {
            0 => 0,
            _ => self.failing_since.unwrap_or(0),
        }
    }

    /// Run the members script in `mode`, bounded well below the connection's response
    /// timeout: a frozen node holding the set must not keep a starting instance from every
    /// shard for long.
    async fn beat(
        &self,
        conn: &mut RedisConn,
        key: &str,
        me: &str,
        mode: &str,
        failing_since: u64,
    ) -> Result<(u64, bool, bool, Vec<String>), redis::RedisError> {
        let reply: Vec<String> = tokio::time::timeout(
            BEAT_WAIT.min(self.ttl / 3),
            members(conn, key, me, self.ttl, mode, failing_since),
        )
        .await
        .unwrap_or_else(|_| {
            Err(redis::RedisError::from((
                redis::ErrorKind::Io,
                "no answer within the heartbeat's deadline",
            )))
        })?;
        Ok(split_reply(reply))
    }

    /// Take in a heartbeat's reply; the members and this instance's standing if they
    /// changed since the last view acted on.
    fn saw(
        &mut self,
        (now, out, others_able, mut members): (u64, bool, bool, Vec<String>),
        mode: &str,
        out_why: Option<&'static str>,
    ) -> Option<(Vec<String>, Standing)> {
        if self.failed_checks > 0 && self.failing_since.is_none() && mode != "2" {
            self.failing_since = Some(now);
        }
        self.others_able_since = if self.failed_checks > 0 && others_able {
            self.others_able_since
                .or_else(|| Some(tokio::time::Instant::now()))
        } else {
            None
        };
        members.sort_unstable();
        let standing = match (mode, out) {
            (_, true) => Standing::Out(out_why.unwrap_or("leaving")),
            ("2", false) => self.last.as_ref().map_or(Standing::Able, |(_, s)| *s),
            ("1", false) => Standing::Able,
            (_, false) => Standing::Unanswered,
        };
        let view = (members, standing);
        if self.last.as_ref() == Some(&view) {
            return None;
        }
        self.last = Some(view.clone());
        Some(view)
    }
}

/// The members script's reply: Redis's time (ms), whether this member is out of the set,
/// whether another member reached the database since this one's checks began to fail, and the
/// live members.
fn split_reply(mut reply: Vec<String>) -> (u64, bool, bool, Vec<String>) {
    let members = reply.split_off(3.min(reply.len()));
    let now = reply.first().and_then(|t| t.parse().ok()).unwrap_or(0);
    let out = reply.get(1).is_some_and(|o| o == "1");
    let others_able = reply.get(2).is_some_and(|o| o == "1");
    (now, out, others_able, members)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_evenly_and_a_stranger_gets_none() {
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        for (shards, members) in [(8, names(&["c", "a", "b"])), (4, names(&["x", "y", "z"]))] {
            let mut counts: Vec<usize> = members
                .iter()
                .map(|me| assign(shards, &members, me).iter().filter(|x| **x).count())
                .collect();
            counts.sort_unstable();
            assert!(counts[counts.len() - 1] - counts[0] <= 1, "{counts:?}");
            // Every shard wanted by exactly one member.
            for k in 0..shards as usize {
                let wanting = members
                    .iter()
                    .filter(|me| assign(shards, &members, me)[k])
                    .count();
                assert_eq!(wanting, 1, "shard {k}");
            }
        }
        let members = names(&["a", "b", "c"]);
        assert!(!assign(8, &members, "d").iter().any(|x| *x));
        assert!(assign(1, &names(&["a"]), "a")[0]);
        // Nobody can consume: everyone tries everything.
        assert!(assign(8, &[], "d").iter().all(|x| *x));
    }

    #[test]
    fn a_member_joining_moves_little_more_than_its_share() {
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let owners = |members: &[String]| -> Vec<String> {
            (0..64)
                .map(|k| {
                    members
                        .iter()
                        .find(|me| assign(64, members, me)[k])
                        .cloned()
                        .unwrap()
                })
                .collect()
        };
        let before = owners(&names(&["w-1", "w-2", "w-3"]));
        let after = owners(&names(&["w-1", "w-2", "w-3", "w-4"]));
        let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        // Its share is 16 of 64; `k mod m` would move 48.
        assert!(moved <= 24, "{moved} of 64 moved");
    }

    #[test]
    fn an_instance_leaves_only_after_another_reached_the_database_for_a_heartbeat_period() {
        let ttl = Duration::from_secs(3);
        let mut heart = Heart::new(ttl);
        assert_eq!(
            heart.say(false, false),
            ("2", None),
            "between heartbeats: a look"
        );
        assert_eq!(heart.say(true, true).0, "0", "a refused layout leaves");
        heart.checked(false);
        assert_eq!(
            heart.say(true, false),
            (
                "0",
                Some("the database has not answered since this instance started")
            ),
            "never able: does not join"
        );
        heart.checked(true);
        assert_eq!(heart.say(true, false), ("1", None));
        for _ in 0..3 {
            heart.checked(false);
        }
        assert_eq!(heart.say(true, false).0, "4", "no failing time yet: stays");
        heart.failing_since = Some(1);
        assert_eq!(heart.say(true, false).0, "4", "nobody else able: stays");
        heart.others_able_since = Some(tokio::time::Instant::now());
        assert_eq!(heart.say(true, false).0, "4", "another able only just now");
        heart.others_able_since = Some(tokio::time::Instant::now() - ttl / 3);
        assert_eq!(heart.say(true, false).0, "0", "another able a period: out");
        heart.checked(true);
        assert_eq!(heart.say(true, false), ("1", None), "back once it answers");
        assert_eq!(heart.failing_since(), 0);
    }

    /// Runs the members script for `me` in `mode`; returns (out, others able, live members).
    async fn members_script(
        conn: &mut redis::aio::MultiplexedConnection,
        me: &str,
        window: u64,
        mode: &str,
        failing_since: u64,
    ) -> (bool, bool, Vec<String>) {
        let reply: Vec<String> = MEMBERS
            .key("members")
            .arg(me)
            .arg(window)
            .arg(mode)
            .arg(failing_since)
            .invoke_async(conn)
            .await
            .unwrap();
        let (_, out, able, members) = split_reply(reply);
        (out, able, members)
    }

    #[tokio::test]
    async fn only_a_live_member_reaching_postgres_counts_as_able() {
        let redis = testkit::RedisServer::start().unwrap();
        let mut conn = redis.connect().await.unwrap();
        let window = 1_000u64;
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
        let now = secs * 1000 + micros / 1000;
        // "a" began failing 5 windows ago; "b" last heartbeat after a database answer 3
        // windows ago, then died (its score stays in the set for 10 windows).
        let failing_since = now - 5 * window;
        let () = redis::cmd("ZADD")
            .arg("members")
            .arg(format!("{}.5", now - 3 * window))
            .arg("b")
            .query_async(&mut conn)
            .await
            .unwrap();
        let (out, able, live) = members_script(&mut conn, "a", window, "4", failing_since).await;
        assert!(!out);
        assert_eq!(live, vec!["a".to_string()]);
        assert!(
            !able,
            "a dead member's old heartbeat counted as another able member"
        );

        // A live member that reaches the database counts; one whose checks fail does not.
        members_script(&mut conn, "c", window, "4", 0).await;
        let (_, able, _) = members_script(&mut conn, "a", window, "4", failing_since).await;
        assert!(!able, "a member whose checks fail counted as able");
        members_script(&mut conn, "c", window, "1", 0).await;
        let (_, able, live) = members_script(&mut conn, "a", window, "4", failing_since).await;
        assert!(able);
        assert_eq!(live.len(), 2, "{live:?}");
    }
}
