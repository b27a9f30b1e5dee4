//! Each user's budgets of requests: sends, history reads, event-stream opens and sign-ins,
//! each a token bucket (a rate kept up, a burst after being idle). They are held in Redis,
//! so every instance of a side draws on one budget: N instances behind a load balancer
//! enforce one limit, not N.
//!
//! A bucket is one key per user and kind holding its theoretical arrival time (GCRA: a
//! token bucket as a single timestamp), read and moved by one script on the key's node, on
//! Redis's clock (instances' clocks never meet). When Redis does not answer within
//! [`REDIS_WAIT`], each instance counts on buckets of its own (the same rate and burst, so
//! N× while it lasts) and asks Redis again [`LOCAL_FOR`] later: a Redis outage costs
//! precision, never a request. `chat_budgets_local` says when that is so.
//!
//! Invariant: a request is charged at least once (in Redis, or on the instance when Redis
//! did not answer in time; one Redis answered too late is charged in both), and a refusal
//! names how long to wait.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use outbox_core::connect::{RedisConn, RedisTarget};
use outbox_core::stream::keys;
use tracing::{info, warn};

use super::quota::Buckets;
use crate::side::Side;

/// The most a request waits for Redis to judge it (a round trip is well under a millisecond
/// on a healthy network); past it the instance's own buckets judge.
const REDIS_WAIT: Duration = Duration::from_millis(100);
/// How long the instance counts alone after Redis failed to answer, before asking again.
const LOCAL_FOR: Duration = Duration::from_secs(1);

/// What a budget meters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Send,
    History,
    StreamOpen,
    SignIn,
}

impl Kind {
    const ALL: [Kind; 4] = [Kind::Send, Kind::History, Kind::StreamOpen, Kind::SignIn];

    /// The kind's name in keys, metrics and answers.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Send => "send",
            Kind::History => "history",
            Kind::StreamOpen => "stream_open",
            Kind::SignIn => "sign_in",
        }
    }

    /// The reason a refusal is counted under (`chat_requests_refused_total`).
    pub(crate) fn refusal(self) -> &'static str {
        match self {
            Kind::Send => "send_rate",
            Kind::History => "history_rate",
            Kind::StreamOpen => "stream_open_rate",
            Kind::SignIn => "sign_in_rate",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A rate kept up (per second) and the burst allowed after being idle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Budget {
    pub rate: f64,
    pub burst: u32,
}

impl Budget {
    /// Microseconds between two requests at the steady rate.
    fn interval_micros(self) -> u64 {
        (1e6 / self.rate).ceil() as u64
    }
}

/// Every user's budgets on this side.
pub(crate) struct Budgets {
    side: Side,
    budgets: [Budget; 4],
    /// The instance's own buckets, judging while Redis does not.
    local: [Buckets<String>; 4],
    shared: Option<Shared>,
}

/// The Redis side: a connection once one was made (it reconnects by itself), and until when
/// the instance counts alone.
struct Shared {
    conn: OnceLock<RedisConn>,
    /// Until when the instance counts alone (`None`: Redis judges). The gauge is set with
    /// it, under its lock.
    local_until: Mutex<Option<Instant>>,
    local: Arc<prometheus::IntGauge>,
    /// One request asks Redis again after [`LOCAL_FOR`], the others count here meanwhile:
    /// during an outage that leaves requests unanswered, one waits [`REDIS_WAIT`], not all.
    probing: AtomicBool,
    /// An outage was logged; cleared when Redis answers again, so the next one is too.
    warned: AtomicBool,
}

/// GCRA on one key: KEYS[1] holds the theoretical arrival time (microseconds on Redis's
/// clock); ARGV: the interval (µs), the burst, and 1 to take or -1 to give one back.
/// Returns 0 when taken (or given back), else the microseconds until one may be.
pub(crate) const TAKE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local new
if ARGV[3] == '-1' then
  new = tat - interval
  if new <= now then
    redis.call('DEL', KEYS[1])
    return 0
  end
else
  new = tat + interval
  if new - now > burst * interval then
    return math.max(1, math.ceil(new - now - burst * interval))
  end
end
redis.call('SET', KEYS[1], string.format('%.0f', new), 'PX', math.ceil((new - now) / 1000) + 1)
return 0
";

static SCRIPT: std::sync::LazyLock<outbox_core::functions::Function> =
    std::sync::LazyLock::new(|| crate::functions::LIBRARY.function("take_budget"));

impl Budgets {
    /// Budgets counted by this instance alone (no Redis to share them through).
    pub(crate) fn local(side: Side, budgets: [Budget; 4]) -> Self {
        Self {
            side,
            budgets,
            local: budgets.map(|b| Buckets::new(b.rate, f64::from(b.burst))),
            shared: None,
        }
    }

    /// Budgets shared through `redis` by every instance of `side`; connected in the
    /// background (until then, and whenever Redis does not answer, counted here).
    /// `local` is set to 1 while the instance counts alone.
    pub(crate) fn shared(
        side: Side,
        budgets: [Budget; 4],
        redis: RedisTarget,
        local: prometheus::IntGauge,
    ) -> Arc<Self> {
        local.set(1);
        let this = Arc::new(Self {
            shared: Some(Shared {
                conn: OnceLock::new(),
                local_until: Mutex::new(None),
                local: Arc::new(local),
                probing: AtomicBool::new(false),
                warned: AtomicBool::new(false),
            }),
            ..Self::local(side, budgets)
        });
        let connecting = Arc::downgrade(&this);
        tokio::spawn(async move {
            let mut backoff = outbox_core::backoff::Backoff::new(
                Duration::from_millis(200),
                Duration::from_secs(5),
            );
            loop {
                let Some(budgets) = connecting.upgrade() else {
                    return;
                };
                match redis.connect(REDIS_WAIT.max(Duration::from_secs(1))).await {
                    Ok(conn) => {
                        let shared = budgets.shared.as_ref().expect("shared budgets");
                        let _ = shared.conn.set(conn);
                        shared.local.set(0);
                        info!("users' budgets are shared through Redis");
                        return;
                    }
                    Err(e) => {
                        warn!(error = %e, "cannot reach Redis for the users' budgets; counting them on this instance meanwhile");
                    }
                }
                drop(budgets);
                tokio::time::sleep(backoff.next_delay()).await;
            }
        });
        this
    }

    pub(crate) fn budget(&self, kind: Kind) -> Budget {
        self.budgets[kind.index()]
    }

    /// Take one of `user`'s `kind`, or say how long until there is one.
    pub(crate) async fn take(&self, kind: Kind, user: &str) -> Result<(), Duration> {
        if let Some(judged) = self.in_redis(kind, user, 1).await {
            return judged;
        }
        self.local[kind.index()].take(&user.to_string())
    }

    /// Give back one taken by [`Budgets::take`] that cost nothing (where it was taken, as
    /// far as can be told: a give-back that meets Redis down is given back here).
    pub(crate) async fn give_back(&self, kind: Kind, user: &str) {
        if self.in_redis(kind, user, -1).await.is_none() {
            self.local[kind.index()].give_back(&user.to_string());
        }
    }

    /// Redis's judgement, or `None` when Redis is not to be asked now or did not answer
    /// in time (the instance then counts alone for [`LOCAL_FOR`]). A judgement that comes
    /// after [`REDIS_WAIT`] was charged in Redis too: such a request may count twice, once
    /// in each place (never zero times).
    async fn in_redis(&self, kind: Kind, user: &str, cost: i8) -> Option<Result<(), Duration>> {
        let shared = self.shared.as_ref()?;
        let mut conn = shared.conn.get()?.clone();
        let _probe = {
            let until = shared.local_until.lock().expect("not poisoned");
            match *until {
                None => None,
                Some(at) if Instant::now() < at => return None,
                // Time to ask again: one request does, the rest count here until it knows.
                Some(_) => {
                    if shared.probing.swap(true, Ordering::AcqRel) {
                        return None;
                    }
                    Some(Probe(&shared.probing))
                }
            }
        };
        let budget = self.budget(kind);
        let mut invocation = SCRIPT.key(keys::budget_key(self.side.as_str(), kind.as_str(), user));
        invocation
            .arg(budget.interval_micros())
            .arg(budget.burst)
            .arg(cost);
        let answered =
            tokio::time::timeout(REDIS_WAIT, invocation.invoke_async::<u64>(&mut conn)).await;
        let judged = match answered {
            Ok(Ok(0)) => Ok(()),
            Ok(Ok(wait)) => Err(Duration::from_micros(wait)),
            failed => {
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {REDIS_WAIT:?}"),
                };
                if !shared.warned.swap(true, Ordering::Relaxed) {
                    warn!(error = %why, "Redis did not judge a user's budget; counting budgets on this instance for now (each instance allows the whole budget)");
                }
                let mut until = shared.local_until.lock().expect("not poisoned");
                *until = Some(Instant::now() + LOCAL_FOR);
                shared.local.set(1);
                return None;
            }
        };
        // Only the probe's answer ends counting alone: a late answer to a request made
        // before the outage says nothing about Redis now.
        let mut until = shared.local_until.lock().expect("not poisoned");
        if until.is_some() && _probe.is_some() {
            *until = None;
            shared.local.set(0);
            if shared.warned.swap(false, Ordering::Relaxed) {
                info!("Redis judges users' budgets again");
            }
        }
        Some(judged)
    }
}

/// Lets the next request ask Redis when dropped.
struct Probe<'a>(&'a AtomicBool);

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl std::fmt::Debug for Budgets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Budgets");
        for kind in Kind::ALL {
            d.field(kind.as_str(), &self.budget(kind));
        }
        d.field("shared", &self.shared.is_some()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_are_whole_microseconds_rounded_up() {
        assert_eq!(
            Budget {
                rate: 5.0,
                burst: 1
            }
            .interval_micros(),
            200_000
        );
        assert_eq!(
            Budget {
                rate: 3.0,
                burst: 1
            }
            .interval_micros(),
            333_334
        );
        assert_eq!(
            Budget {
                rate: 1e-5,
                burst: 1
            }
            .interval_micros(),
            100_000_000_000
        );
    }

    #[tokio::test]
    async fn without_redis_each_kind_is_its_own_bucket() {
        let budgets = Budgets::local(
            Side::Consumers,
            [
                Budget {
                    rate: 1.0,
                    burst: 2,
                },
                Budget {
                    rate: 1.0,
                    burst: 1,
                },
                Budget {
                    rate: 1.0,
                    burst: 1,
                },
                Budget {
                    rate: 1.0,
                    burst: 1,
                },
            ],
        );
        assert!(budgets.take(Kind::Send, "a").await.is_ok());
        assert!(budgets.take(Kind::Send, "a").await.is_ok());
        assert!(budgets.take(Kind::Send, "a").await.is_err());
        // Sends spent take nothing from history.
        assert!(budgets.take(Kind::History, "a").await.is_ok());
        assert!(budgets.take(Kind::History, "a").await.is_err());
        budgets.give_back(Kind::Send, "a").await;
        assert!(budgets.take(Kind::Send, "a").await.is_ok());
    }
}
